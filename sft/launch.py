"""torchrun for sft/finetune_ft.sh, with Ctrl-C in one line. torchrun forwards the signal to the ranks, and rank 0
says what was kept and how to continue (sft.spa_sft_trainer); the launcher then exits with 128 + the signal's number
(130 for Ctrl-C) instead of torchrun's traceback and its notes on shutting the workers down. A rank that dies (killed
for memory, a crash) is one line naming it and its exit code, not torchrun's 30-line report.

    python -m sft.launch --standalone --nproc_per_node=2 -m sft.spa_sft_trainer <overrides>    # torchrun's arguments
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def quiet_shutdown_notes() -> None:
    """torchrun's warnings ("Received 2 death signal, shutting down workers") off; its errors still show. Each of
    its modules sets its own logger's level, so the parent's would not do."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> None:
    quiet_shutdown_notes()
    try:
        torchrun(argv)
    except SignalException as err:
        sys.exit(128 + int(err.sigval))
    except ChildFailedError as err:
        sys.exit(rank_failure(err))


def rank_failure(err: ChildFailedError) -> int:
    """Print one line for the first rank that failed; the launcher's exit status (a rank's own status when it
    exited with one, e.g. 2 after a one-line user error it printed itself; 128 + n when signal n killed it)."""
    rank, failure = err.get_first_failure()
    code = failure.exitcode
    if code > 0:
        if code != 2:  # 2: the rank printed its own one-line error
            print(f"error: SFT rank {rank} exited with status {code}; its output is above", file=sys.stderr)
        return code
    print(killed_line(f"SFT rank {rank}", -code), file=sys.stderr)
    return 128 - code


def killed_line(who: str, signum: int) -> str:
    """The one line for `who` (an SFT rank, or finetune_ft.sh's one process) killed by signal `signum`."""
    hint = " (the kernel's out-of-memory killer? lower data.max_tokens_per_micro_batch)" if signum == 9 else ""
    return f"error: {who} was killed by signal {signum}{hint}"


if __name__ == "__main__":
    main()

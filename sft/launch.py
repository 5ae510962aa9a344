"""torchrun for sft/finetune_ft.sh, with Ctrl-C in one line. torchrun forwards the signal to the ranks, and rank 0
says what was kept and how to continue (sft.spa_sft_trainer); the launcher then exits with 128 + the signal's number
(130 for Ctrl-C) instead of torchrun's traceback and its notes on shutting the workers down.

    python -m sft.launch --standalone --nproc_per_node=2 -m sft.spa_sft_trainer <overrides>    # torchrun's arguments
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
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


if __name__ == "__main__":
    main()

"""Ranks that end with their launcher. torchrun starts each rank in a new session, so killing the process group
of sft/finetune_ft.sh (`kill -- -PGID`, a scheduler cancelling the job) ends torchrun but not the ranks: a rank
trained on for seconds, appending metrics and holding the output directory's lock, so a rerun was refused."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>: the signal the kernel sends this process when its parent exits


def die_with_launcher() -> None:
    """Under torchrun on Linux, have the kernel SIGKILL this rank when the launcher (its parent) exits."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:  # the launcher exited before the request took effect
        os._exit(128 + signal.SIGKILL)

"""Killing the process group of a torchrun launch ends its ranks too (issue 29, case 8)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RANK = """
import os, sys, time
from sft.launcher_death import die_with_launcher
die_with_launcher()
print(os.getpid(), flush=True)
time.sleep(120)
"""


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may linger where no init process reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_rank_ends_when_the_launchers_process_group_is_killed(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        cwd=Path(__file__).resolve().parents[2], env={**os.environ, "OMP_NUM_THREADS": "1"})
    rank = None
    try:
        rank = int(launcher.stdout.readline())
        assert os.getpgid(rank) != launcher.pid  # torchrun gives each rank a session of its own
        os.killpg(launcher.pid, signal.SIGKILL)  # what `kill -KILL -- -<pgid>` of finetune_ft.sh does
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 5
        while is_running(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_running(rank)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        if rank is not None and is_running(rank):
            os.kill(rank, signal.SIGKILL)

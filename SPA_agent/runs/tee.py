"""This process's output copied to a log file from some point on, like `COMMAND 2>&1 | tee LOG` started half-way:
what sft/finetune_ft.sh's one-rank run does once its checks pass and it holds its output directory's lock (the
in-process counterpart of SPA_agent.runs.locked_run, which wraps a command from its start).

    tee_this_process(Path("out/train.log"))   # from here on, stdout and stderr also go to out/train.log
    python -m SPA_agent.runs.tee FD           # the copying child: stdin to stdout and to file descriptor FD

A child process does the copying, not a thread: it outlives this process's output, so the last lines (a Ctrl-C's
one-line message, a traceback, what was written just before a kill) reach the log. It ignores Ctrl-C, SIGTERM and
SIGHUP, which reach it with this process's group, and ends when its input does: when this process exits or dies.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

#: signals the copying child ignores: it ends with its input, after copying the last of it
IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: seconds this process waits at exit for the copy to end (milliseconds, unless a child process of ours still holds
#: the output, one whose own exit handler has yet to end it: the copy then ends with that child, on its own)
FINISH_WAIT_S = 5.0


def copy(source: BinaryIO, log_file: BinaryIO) -> None:
    """Everything read from `source` until it ends, to stdout and `log_file` as it comes. A console that is gone
    (a closed terminal, a reader that quit) stops the copy to the console, not to the log."""
    console = sys.stdout.buffer
    for chunk in iter(lambda: source.read1(1 << 16), b""):
        if console is not None:
            try:
                console.write(chunk)
                console.flush()
            except OSError:
                console = None
        log_file.write(chunk)
        log_file.flush()


def tee_this_process(log: Path, append: bool = False) -> None:
    """From now on, this process's stdout and stderr (file descriptors 1 and 2, so also what native code and child
    processes write there) go, as one stream, to the console's stdout and to `log` (replaced, or appended to).
    At exit this process waits until the child has copied everything."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: a Ctrl-C while the child starts is ignored
    try:
        with open(log, "ab" if append else "wb") as log_file:
            child = subprocess.Popen([sys.executable, "-m", "SPA_agent.runs.tee", str(log_file.fileno())],
                                     stdin=subprocess.PIPE, pass_fds=(log_file.fileno(),))
    finally:
        signal.signal(signal.SIGINT, handler)
    console = os.dup(1), os.dup(2)
    os.dup2(child.stdin.fileno(), 1)
    os.dup2(child.stdin.fileno(), 2)
    child.stdin.close()
    atexit.register(_finish, child, console)


def _finish(child: subprocess.Popen, console: tuple[int, int]) -> None:
    """Give file descriptors 1 and 2 back to the console (ending the child's input, unless a child process of ours
    still holds it) and wait for the copy to end (FINISH_WAIT_S at most)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os.dup2(console[0], 1)
    os.dup2(console[1], 2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(FINISH_WAIT_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m SPA_agent.runs.tee", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fd", type=int, help="open file descriptor of the log, which stdin is copied to besides stdout")
    args = parser.parse_args(argv)
    for signum in IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    with open(args.fd, "wb") as log_file:
        copy(sys.stdin.buffer, log_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())

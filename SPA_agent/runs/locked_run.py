"""Run a command while holding an output directory's lock, copying its output (stdout and stderr) to the console
and to a log file in that directory, like `COMMAND 2>&1 | tee LOG`.

    python -m SPA_agent.runs.locked_run --dir OUT --log OUT/train.log [--append] -- COMMAND...

sft/finetune_ft.sh launches torchrun this way: the lock is taken before anything is written into the directory, its
log included, so a second run into the same directory stops in one line (exit status 2) instead of overwriting the
first run's log and failing later in a rank. The command finds this process's pid in $SPA_LOCK_HOLDER and holds its
lock as its own (`dir_lock.adopt_locks_of`). Ctrl-C reaches the command from the terminal; this process waits for it
to end, then releases the lock and exits with its status.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from SPA_agent.runs.dir_lock import HOLDER_ENV, DirLock
from SPA_agent.runs.tee import copy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m SPA_agent.runs.locked_run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="output directory to lock (created)")
    parser.add_argument("--log", type=Path, required=True, help="file the command's output is copied to")
    parser.add_argument("--append", action="store_true", help="append to the log instead of replacing it")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and the command to run")
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        parser.error("no command given after --")
    return args


def run_teed(command: list[str], log: Path, append: bool) -> int:
    """Run `command` with its output copied to stdout and `log`; its exit status (128 + n when killed by signal n)."""
    with open(log, "ab" if append else "wb") as log_file:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, HOLDER_ENV: str(os.getpid())})
        forward = lambda signum, frame: proc.send_signal(signum)
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGHUP, forward)
        signal.signal(signal.SIGINT, lambda signum, frame: None)  # the terminal sends it to the command as well
        copy(proc.stdout, log_file)
        code = proc.wait()
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lock = DirLock(args.dir)
    try:
        lock.acquire()
    except ValueError as err:  # in use by another run, or not writable: before anything is written
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        return run_teed(args.command, args.log, args.append)
    finally:
        lock.release()


if __name__ == "__main__":
    sys.exit(main())

"""One writer per output directory: `<dir>/.lock` holds the owner's pid, host and start time.

The lock file is created with its content in one step (written to a private temporary file, then hard-linked
to the lock name, which fails if the name exists), so another process never reads a half-written lock. A lock
whose pid no longer runs on this host is stale (a killed run) and is taken over; a live one, or one from
another host (whose pid cannot be checked), makes `DirLock` raise `DirectoryLockedError`: one line naming the
owner and what to do.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"
#: set by SPA_agent.runs.locked_run for the command it runs: the pid whose locks that command holds as its own
HOLDER_ENV = "SPA_LOCK_HOLDER"
#: pids (of this host) of launchers whose locks this process counts as its own (`adopt_locks_of`)
_launcher_pids: set[int] = set()


class DirectoryLockedError(ValueError):
    """Another live process writes the directory (a user error: one line, exit status 2)."""


class UnwritableDirectoryError(ValueError):
    """The output directory cannot be created or written (read-only, no permission)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def read_owner(directory: Path) -> dict | None:
    """The lock's content (`pid`, `host`, `started`), None when unlocked; an unreadable lock reads as {}."""
    try:
        return json.loads((Path(directory) / LOCK_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except ValueError:
        return {}


def is_stale(owner: dict) -> bool:
    """A lock of this host whose process is gone (or an unreadable one)."""
    if not owner:
        return True
    return owner.get("host") == socket.gethostname() and not _pid_alive(int(owner.get("pid", -1)))


def adopt_locks_of(pid: int) -> None:
    """Count the locks held by process `pid`, this process's launcher (`python -m SPA_agent.runs.locked_run`),
    as this process's own: they were taken for it before it started, so that nothing, not even the launcher's
    log, was written into the directory without the lock."""
    _launcher_pids.add(int(pid))


def _is_launchers(owner: dict) -> bool:
    return owner.get("host") == socket.gethostname() and owner.get("pid") in _launcher_pids


def describe(directory: Path, owner: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return (f"{directory} is in use by pid {owner.get('pid')} on {owner.get('host')} (since {started}): wait for "
            f"that run to finish or choose another output directory; if that process is gone, delete "
            f"{Path(directory) / LOCK_FILE}")


def check_unlocked(directory: Path) -> None:
    """Raise DirectoryLockedError if a live process holds the directory's lock (for readers and preflights)."""
    owner = read_owner(directory)
    if owner is not None and not is_stale(owner) and owner.get("pid") != os.getpid() \
            and not _is_launchers(owner):
        raise DirectoryLockedError(describe(directory, owner))


def check_writable(directory: Path) -> None:
    """Raise UnwritableDirectoryError unless `directory`, or the nearest existing directory above it, can be
    written (a check for preflights; taking the lock is the real test)."""
    path = Path(directory).absolute()
    while not path.exists():
        path = path.parent
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise UnwritableDirectoryError(f"cannot write to {directory} ({path} is not a writable directory); "
                                       "choose a writable output directory")


class DirLock:
    """`with DirLock(dir):` — hold the directory's lock for the block (the directory is created)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.held = False

    def acquire(self) -> DirLock:
        """Take the lock (a no-op when held); also the first write into the directory, so an unwritable one
        fails here, early."""
        if self.held:
            return self
        content = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        tmp = self.directory / f".lock.{os.getpid()}.tmp"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(content, encoding="utf-8")
        except OSError as err:
            raise UnwritableDirectoryError(f"cannot write to {self.directory}: {err.strerror or err}; "
                                           "choose a writable output directory") from None
        try:
            for _ in range(2):  # second try after removing a stale lock
                try:
                    os.link(tmp, self.path)
                    self.held = True
                    return self
                except FileExistsError:
                    owner = read_owner(self.directory)
                    if owner and _is_launchers(owner) and not is_stale(owner):  # its launcher took it for it
                        self.held = True
                        return self
                    if owner is not None and not is_stale(owner):
                        raise DirectoryLockedError(describe(self.directory, owner)) from None
                    self.path.unlink(missing_ok=True)
            raise DirectoryLockedError(f"{self.directory}: another run took the lock at the same moment")
        finally:
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held:
            owner = read_owner(self.directory)
            if owner and owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

"""One writer per directory: live locks refuse, stale ones are taken over, unwritable directories fail early."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from SPA_agent.runs.dir_lock import (
    LOCK_FILE,
    DirectoryLockedError,
    DirLock,
    UnwritableDirectoryError,
    check_unlocked,
    check_writable,
    read_owner,
)


def _write_lock(directory, pid, host=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": 0}))


def _dead_pid():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_lock_records_owner_and_is_removed_on_exit(tmp_path):
    with DirLock(tmp_path / "run"):
        owner = read_owner(tmp_path / "run")
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    assert [p.name for p in (tmp_path / "run").iterdir()] == []  # no temporary file left


def test_live_lock_refuses_with_one_line_naming_the_owner(tmp_path):
    _write_lock(tmp_path, os.getppid())
    with pytest.raises(DirectoryLockedError, match=rf"in use by pid {os.getppid()} on {socket.gethostname()}") as err:
        DirLock(tmp_path).acquire()
    assert "\n" not in str(err.value)
    with pytest.raises(DirectoryLockedError):
        check_unlocked(tmp_path)
    assert read_owner(tmp_path)["pid"] == os.getppid()  # the owner's lock is untouched


def test_a_second_process_cannot_take_a_held_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from SPA_agent.runs.dir_lock import DirLock; "
         f"lock = DirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryLockedError, match=f"pid {holder.pid} "):
            DirLock(tmp_path).acquire()
    finally:
        holder.communicate("")
    with DirLock(tmp_path):  # the holder exited without releasing: its lock is stale now
        assert read_owner(tmp_path)["pid"] == os.getpid()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    _write_lock(tmp_path, _dead_pid())
    check_unlocked(tmp_path)
    with DirLock(tmp_path):
        assert read_owner(tmp_path)["pid"] == os.getpid()


def test_unreadable_lock_is_stale(tmp_path):
    (tmp_path / LOCK_FILE).write_text("{half")
    with DirLock(tmp_path):
        assert read_owner(tmp_path)["pid"] == os.getpid()


def test_lock_of_another_host_is_not_taken_over(tmp_path):
    _write_lock(tmp_path, _dead_pid(), host="some-other-host")
    with pytest.raises(DirectoryLockedError, match="some-other-host"):
        DirLock(tmp_path).acquire()


def test_unwritable_directory_fails_before_any_work(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UnwritableDirectoryError, match="cannot write to .*choose a writable output directory"):
        DirLock(tmp_path / "file" / "out").acquire()
    with pytest.raises(UnwritableDirectoryError, match="is not a writable directory"):
        check_writable(tmp_path / "file" / "out" / "deeper")
    check_writable(tmp_path / "new" / "dir")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_existing_directory_that_no_one_can_write_fails():
    """An existing directory where creating a file fails, for root too (CI runs as root, which chmod does not
    stop): /proc/self, whose entries the kernel makes. Both the preflight check and the lock refuse it."""
    with pytest.raises(UnwritableDirectoryError, match=r"^cannot write to /proc/self/out \(/proc/self is not a "
                                                       r"writable directory\); choose a writable output directory$"):
        check_writable(Path("/proc/self/out"))
    with pytest.raises(UnwritableDirectoryError, match=r"^cannot write to /proc/self: .*; choose a writable output "
                                                       r"directory$"):
        DirLock(Path("/proc/self")).acquire()

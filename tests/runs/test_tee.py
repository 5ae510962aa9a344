"""SPA_agent.runs.tee: a process's output copied to a log from some point on, its last lines included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=False,
                          timeout=60, cwd=REPO, **kwargs)


def test_the_output_after_the_call_goes_to_the_console_and_the_log_as_one_stream(tmp_path):
    log = tmp_path / "train.log"
    result = run_python(f"""
        import os, sys
        from pathlib import Path
        from SPA_agent.runs.tee import tee_this_process
        print("before")
        tee_this_process(Path({str(log)!r}))
        print("stdout")
        print("stderr", file=sys.stderr)
        os.write(1, b"native\\n")
        sys.exit(3)
    """)
    assert result.returncode == 3
    assert log.read_text() == "stdout\nstderr\nnative\n"
    assert result.stdout == "before\nstdout\nstderr\nnative\n" and result.stderr == ""


def test_the_log_is_replaced_or_appended_to(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("the first run\n")
    code = """
        import sys
        from pathlib import Path
        from SPA_agent.runs.tee import tee_this_process
        tee_this_process(Path(sys.argv[1]), append=sys.argv[2] == "1")
        print("the second run")
    """
    for append, expected in (("1", "the first run\nthe second run\n"), ("0", "the second run\n")):
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(log), append], capture_output=True,
                                text=True, check=False, timeout=60, cwd=REPO)
        assert result.returncode == 0, result.stderr
        assert log.read_text() == expected


def test_what_a_killed_process_wrote_last_reaches_the_log(tmp_path):
    log = tmp_path / "train.log"
    result = run_python(f"""
        import os, signal
        from pathlib import Path
        from SPA_agent.runs.tee import tee_this_process
        tee_this_process(Path({str(log)!r}))
        print("the last line", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert result.returncode == -signal.SIGKILL
    assert log.read_text() == "the last line\n" and result.stdout == "the last line\n"


def test_ctrl_c_to_the_process_group_leaves_the_copy_running(tmp_path):
    """The terminal sends Ctrl-C to the whole foreground group: the copying child must outlive it to copy the
    process's answer to it."""
    log = tmp_path / "train.log"
    code = f"""
        import sys, time
        from pathlib import Path
        from SPA_agent.runs.tee import tee_this_process
        tee_this_process(Path({str(log)!r}))
        print("ready", flush=True)
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted: one line", file=sys.stderr, flush=True)
            sys.exit(130)
    """
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                               cwd=REPO, start_new_session=True)
    assert process.stdout.readline() == "ready\n"
    os.killpg(process.pid, signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 130 and rest == "interrupted: one line\n"
    assert log.read_text() == "ready\ninterrupted: one line\n"


def test_a_child_still_holding_the_output_does_not_hold_the_exit(tmp_path):
    """A process started after the call inherits the output; one that outlives this process's exit handlers must not
    keep it from exiting (the copy then ends with that child)."""
    log = tmp_path / "train.log"
    code = """
        import subprocess, sys
        from pathlib import Path
        from SPA_agent.runs import tee
        tee.FINISH_WAIT_S = 0.5
        tee.tee_this_process(Path(sys.argv[1]))
        print(subprocess.Popen(["sleep", "60"]).pid, flush=True)
    """
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(log)], stdout=subprocess.DEVNULL,
                               cwd=REPO)
    try:
        assert process.wait(timeout=30) == 0
    finally:
        os.kill(int(log.read_text()), signal.SIGKILL)

"""benchmarks/row_metrics.py: rows' training metrics averaged over windows of steps, each arm counted once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "row_metrics.py"


def write_arm(directory: Path, name: str, kl_per_step: float, steps: int) -> None:
    """Validation at steps 0 and 25; at every step 1..steps a KL of kl_per_step × step, and a group spread of 2.0
    only in the first five steps."""
    records = [{"step": 0, "val-env/SimpleSokoban/success": 0.2}]
    for step in range(1, steps + 1):
        record = {"step": step, "diag/kl_ref/answer": kl_per_step * step}
        if step <= 5:
            record["rollout/in_group_std"] = 2.0
        if step == 25:
            record["val-env/SimpleSokoban/success"] = 0.3
        records.append(record)
    (directory / name).mkdir()
    (directory / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_each_rows_mean_over_its_arms_means_in_each_window(tmp_path):
    """The rows in the order their arms are read (a folder's by name), each arm's mean over its logged steps of the
    window, then their mean."""
    write_arm(tmp_path, "spa_s1", 0.01, 30)
    write_arm(tmp_path, "spa_s2", 0.03, 10)  # stopped at step 10: counts once, over the steps it has
    write_arm(tmp_path, "format_s1", 0.001, 30)
    done = run(str(tmp_path), "--windows", "1:10", "21:30", "--keys", "diag/kl_ref/answer", "rollout/in_group_std")
    assert done.returncode == 0, done.stderr
    # steps 1-10: spa_s1 0.01 × 5.5 = 0.055, spa_s2 0.03 × 5.5 = 0.165, their mean 0.110; format 0.0055
    # steps 21-30: spa_s1 0.01 × 25.5 = 0.255 (spa_s2 has no step there); no arm logs the spread there
    assert done.stdout == (
        "steps 1–10\n\n| row | diag/kl_ref/answer | rollout/in_group_std |\n|---|---|---|\n"
        "| format | 0.0055 (1) | 2.0000 (1) |\n| spa | 0.1100 (2) | 2.0000 (2) |\n\n"
        "steps 21–30\n\n| row | diag/kl_ref/answer | rollout/in_group_std |\n|---|---|---|\n"
        "| format | 0.0255 (1) |  |\n| spa | 0.2550 (1) |  |\n")


def test_a_bad_window_or_a_key_no_arm_logs_is_a_one_line_error(tmp_path):
    write_arm(tmp_path, "spa_s1", 0.01, 30)
    for windows, key, message in ((["10:1"], "diag/kl_ref/answer", "a window is FIRST:LAST, two steps with FIRST <= "
                                   "LAST, got '10:1'"),
                                  (["1-10"], "diag/kl_ref/answer", "got '1-10'"),
                                  (["1:10"], "critic/vf_explained_var", "no arm logs critic/vf_explained_var")):
        done = run(str(tmp_path), "--windows", *windows, "--keys", key)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr

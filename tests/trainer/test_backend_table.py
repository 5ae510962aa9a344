"""benchmarks/backend_table.py: the steady phase table of two runs (benchmarks/backend_speed.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "backend_table.py"


def write_run(path: Path, steps: list[dict[str, float]]) -> Path:
    path.write_text("".join(json.dumps({"step": i + 1, **{f"timing_s/{k}": v for k, v in s.items()}}) + "\n"
                            for i, s in enumerate(steps)))
    return path


def test_the_table_holds_the_median_after_the_first_step_and_the_verl_only_rows(tmp_path):
    # the last step of each run also saves (and validates): the step row is its training only
    local = write_run(tmp_path / "local.jsonl", [
        {"gen": 90.0, "old_log_prob": 9.0, "step": 120.0},  # warm-up, left out
        {"gen": 20.0, "old_log_prob": 0.6, "step": 30.0},
        {"gen": 22.0, "old_log_prob": 0.8, "step": 32.0},
        {"gen": 21.0, "old_log_prob": 0.7, "step": 43.0, "save_checkpoint": 12.0}])
    verl = write_run(tmp_path / "verl.jsonl", [
        {"gen": 40.0, "rollout_wake": 2.0, "old_log_prob": 5.0, "old_log_prob_call": 4.0, "step": 60.0},
        {"gen": 13.0, "rollout_wake": 0.6, "old_log_prob": 1.2, "old_log_prob_call": 0.8, "step": 19.0},
        {"gen": 14.0, "rollout_wake": 0.5, "old_log_prob": 1.1, "old_log_prob_call": 0.7, "step": 21.0},
        {"gen": 12.0, "rollout_wake": 0.7, "old_log_prob": 1.0, "old_log_prob_call": 0.9, "step": 35.0,
         "testing": 5.0, "save_checkpoint": 10.0}])
    out = subprocess.run([sys.executable, str(SCRIPT), str(local), str(verl), "--labels", "local", "verl"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "| phase (s) | local | verl | ratio |"
    assert out[2:] == [
        "| gen | 21.00 | 13.00 | 0.62 |",
        "| rollout_wake | – | 0.60 | – |",
        "| old_log_prob | 0.70 | 1.10 | 1.57 |",
        "| old_log_prob_call | – | 0.80 | – |",
        "| **step** | 31.00 | 20.00 | 0.65 |",
        "| steps in the median | 3 | 3 | |"]


def test_a_missing_metrics_file_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().startswith("error: no metrics file:")
    assert "Traceback" not in result.stderr

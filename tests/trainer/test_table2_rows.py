"""benchmarks/table2_rows.py: issue 43's Table 2 rows, seeds pooled, compared at the step every arm reached."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "table2_rows.py"


def write_arm(directory: Path, name: str, success: dict[int, float], prediction: dict[int, float] | None = None,
              observation: dict[int, float] | None = None):
    records = []
    for step in range(max(success) + 1):
        record = {"step": step, "train/SimpleSokoban/success": 0.1}
        if step in success:
            record["val-env/SimpleSokoban/success"] = success[step]
        if prediction and step in prediction:
            record["val-env/SimpleSokoban/worldmodel/prediction_exact"] = prediction[step]
        if observation and step in observation:
            record["val-env/SimpleSokoban/worldmodel/observation_exact"] = observation[step]
        records.append(record)
    (directory / name).mkdir(parents=True)
    (directory / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_rows_pool_their_seeds_at_the_last_step_every_arm_reached(tmp_path):
    wm, nowm = tmp_path / "lease1" / "wm", tmp_path / "lease2" / "nowm"
    write_arm(wm, "spa_s0", {0: 0.2, 25: 0.25, 50: 0.35}, prediction={0: 0.3, 25: 0.2, 50: 0.1},
              observation={0: 1.0, 25: 0.9, 50: 0.8})
    write_arm(wm, "spa_s1", {0: 0.2, 25: 0.35}, prediction={0: 0.2, 25: 0.1}, observation={0: 0.98, 25: 0.96})
    write_arm(nowm, "format_s0", {0: 0.2, 25: 0.2, 50: 0.2, 75: 0.2})
    done = run(wm, nowm, "--val-episodes", "512")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("| row | seeds | step 0 | step 25 |")  # spa_s1 stopped at step 25
    # spa at 25: mean 0.300 over 2 x 512 episodes, Wilson [0.273, 0.329]; at 0: 0.200 over 1024, [0.177, 0.226]
    assert lines[2] == ("| spa | 2 | 0.200 [0.177, 0.226] | 0.300 [0.273, 0.329] | +0.100 | 0.250, 0.350 "
                        "| 0.990 → 0.930 | 0.250 → 0.150 |")
    assert lines[3] == "| format | 1 | 0.200 [0.168, 0.237] | 0.200 [0.168, 0.237] | +0.000 | 0.200 |  |  |"


def test_a_chosen_step_names_the_arms_that_have_not_reached_it(tmp_path):
    write_arm(tmp_path, "spa_s0", {0: 0.2, 25: 0.25, 50: 0.35})
    write_arm(tmp_path, "spa_s1", {0: 0.2, 25: 0.35})
    done = run(tmp_path, "--step", "50")
    assert done.returncode == 0, done.stderr
    assert "| spa | 1 | 0.200 [0.168, 0.237] | 0.350 [0.310, 0.392] | +0.150 | 0.350 |  |  |" in done.stdout
    assert done.stdout.strip().endswith("not validated at step 50: spa_s1")


def test_no_arms_is_a_one_line_error(tmp_path):
    done = run(tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == f"error: no <arm>/metrics.jsonl under {tmp_path}"


def test_onset_is_where_success_rises_to_the_level_and_stays_there(tmp_path):
    write_arm(tmp_path, "spa_s0", {0: 0.1, 25: 0.3, 50: 0.2, 75: 0.3, 100: 0.4})  # a dip at 50: from 75 on
    write_arm(tmp_path, "spa_s1", {0: 0.1, 25: 0.3, 50: 0.35})
    write_arm(tmp_path, "format_s0", {0: 0.2, 25: 0.2, 50: 0.24})  # never there
    done = run(tmp_path, "--onset", "0.25")
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("| row | arm | onset: success ≥ 0.250 from | last validation |\n|---|---|---|---|\n"
                                "| format | format_s0 | — | 50 |\n"  # (the arms in their folders' order)
                                "| spa | spa_s0 | 75 | 100 |\n| spa | spa_s1 | 25 | 50 |\n")

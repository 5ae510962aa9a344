"""benchmarks/sft_startup.py at its smallest: one traced run of finetune_ft.sh with one rank on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sft_fixtures import synthetic_rows, write_rows

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_startup_benchmark_traces_the_one_process_to_its_first_step(tmp_path):
    write_rows(tmp_path / "wm_train.parquet", *synthetic_rows(8))
    write_rows(tmp_path / "wm_val.parquet", *synthetic_rows(4, seed=1))
    (tmp_path / "data_card.json").write_text("{}")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "sft_startup.py"), "--data", str(tmp_path), "--repeats", "1", "--",
         "data.max_length=96", "data.train_batch_size=4", "data.max_tokens_per_micro_batch=192", "trainer.device=cpu"],
        capture_output=True, text=True, check=False, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    run, summary = (json.loads(line) for line in result.stdout.splitlines())
    trainers = [p for p in run["processes"] if "sft.spa_sft_trainer" in p["argv"]]
    assert len(trainers) == 1 and trainers[0]["start_s"] < trainers[0]["torch_s"] < trainers[0]["task_s"]
    assert 0 < run["to_first_step_s"] <= run["step_line_s"] <= run["total_s"]
    phases = {key.split(":")[1] for key in run["phases_s"]}
    assert {"preflight", "setup", "_build_data", "_build_model", "train_step"} <= phases
    assert summary["runs"] == 1 and summary["median"]["to_first_step_s"] == run["to_first_step_s"]

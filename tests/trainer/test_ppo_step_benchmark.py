"""benchmarks/ppo_step.py at CI size (--smoke), so the script cannot rot."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PHASES = {"generation", "old_log_prob", "ref", "values", "update_critic", "update_actor", "total"}
OVERRIDES = ["actor_rollout_ref.model.enable_gradient_checkpointing=False"]


def _smoke_run(directory: Path) -> dict:
    """The smoke run, a child process that runs beside the other tests (tests/conftest.py, `background`)."""
    return {"args": [sys.executable, "benchmarks/ppo_step.py", "--smoke", "--json", str(directory / "step.json"),
                     "--profile", "update_actor", "--override", *OVERRIDES],
            "cwd": ROOT, "timeout": 300, "env": {**os.environ, "OMP_NUM_THREADS": "1"}}


@pytest.mark.slow
@pytest.mark.background(command=_smoke_run)
def test_smoke_run_prints_every_phase(background_run):
    (result,), tmp_path = background_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "Self CPU time total" in result.stdout  # the update's kernel table
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert json.loads((tmp_path / "step.json").read_text()) == lines
    assert {line["metric"].removeprefix("ppo_step/") for line in lines} == PHASES
    assert all(line["seconds"] > 0 for line in lines)
    total = lines[-1]
    assert 0 < total["sampled_tokens"] <= 8 * 2 * 16  # 8 trajectories × 2 turns × at most 16 tokens
    assert total["train_tokens"] > 0
    assert total["micro"] == "packed" and total["budget"] == 64  # token-budget packed micro-batches
    assert total["overrides"] == OVERRIDES

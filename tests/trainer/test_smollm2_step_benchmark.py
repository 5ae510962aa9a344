"""benchmarks/smollm2_step.py at CI size (--smoke: the tiny model on CPU through the static decoder), so the script
cannot rot."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PHASES = {"gen", "filter", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor"}


def _smoke_run(directory: Path) -> dict:
    """The smoke run, a child process that runs beside the other tests (tests/conftest.py, `background`)."""
    return {"args": [sys.executable, "benchmarks/smollm2_step.py", "--smoke", "--steps", "2", "--profile", "train",
                     "--json", str(directory / "s.json")],
            "cwd": ROOT, "timeout": 300, "env": {**os.environ, "OMP_NUM_THREADS": "1"}}


@pytest.mark.slow
@pytest.mark.background(command=_smoke_run)
def test_smoke_run_times_every_phase_and_the_decoder(background_run):
    (result,), tmp_path = background_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "profile of one train by self_cpu_time_total" in result.stdout and "Self CPU time total" in result.stdout
    # --profile train starts the profiler when the rollout ends: the backward passes are in its table, the
    # decoder's sampling (exponential_ draws, among its ten costliest operators) is not
    table = result.stdout.split("profile of one train")[1]
    assert "MmBackward0" in table and "aten::exponential_" not in table
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert json.loads((tmp_path / "s.json").read_text()) == lines
    steps = [line for line in lines if line["metric"] == "step"]
    assert [line["step"] for line in steps] == [1, 2]
    for step in steps:
        assert PHASES <= {key.removeprefix("timing_s/") for key in step}
        assert 0 < step["gen_model_s"] <= step["timing_s/gen"]
        assert step["gen_calls"] == 2 and step["gen_sequences"] == 16  # 2 turns × 8 trajectories
        assert 0 < step["sampled_tokens"] <= 16 * 16  # 16 sequences × at most 16 new tokens
        assert step["prefill_tokens"] > 0 and 0 < step["decode_steps"] <= 2 * 15  # ≤ 15 feeds a turn
        assert step["compact_steps"] == 0  # decode compaction (generator.compact_decode_rows) is off by default
        calls = step["decoder_calls"]  # one a turn: 8 trajectories, their prompts, the loop's feeds
        assert [call["rows"] for call in calls] == [8, 8]
        assert sum(call["decode_steps"] for call in calls) == step["decode_steps"]
        assert calls[0]["prompt_max"] < calls[1]["prompt_max"]  # the second turn's prompt holds the first turn
        assert step["prefill_s"] + step["decode_s"] <= step["gen_model_s"]
    validation = next(line for line in lines if line["metric"] == "validation")
    assert validation["gen_sequences"] == 2 * 4 * 2  # 2 puzzles × 4 samples × 2 turns
    summary = lines[-1]
    assert summary["metric"] == "summary" and summary["steady_steps"] == 1 and summary["compact_steps"] == 0
    assert summary["total"] == steps[1]["timing_s/step"]


@pytest.mark.slow
def test_pipelined_turns_reusing_the_cache_time_every_prefill(tmp_path):
    """With generator.reuse_prefix_cache the later turns prefill suffixes past the cached ids (not `_prefill`): each
    is still one timed decoder call, so `prefill_s` holds every prefill of the rollout."""
    import subprocess

    result = subprocess.run([sys.executable, "benchmarks/smollm2_step.py", "--smoke", "--steps", "2", "--no-val",
                             "agent_proxy.pipeline_turns=true", "generator.reuse_prefix_cache=true"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"metric": "step"')]
    for step in steps:
        calls = step["decoder_calls"]  # the first turn's whole prompts, then the second turn's suffixes
        assert [call["rows"] for call in calls] == [8, 8]
        assert calls[0]["prompt_max"] < calls[1]["prompt_max"] and step["reused_tokens"] > 0
        assert step["prefill_s"] == pytest.approx(sum(call["prefill_s"] for call in calls), abs=2e-3)

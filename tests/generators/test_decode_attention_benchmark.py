"""benchmarks/decode_attention_kernels.py at CI size (--smoke: tiny shapes on the CPU under Triton's interpreter), so
the script the next GPU lease runs cannot rot."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from SPA_agent.generators import split_kv_decode

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not split_kv_decode.available(), reason="needs triton (pip install triton)")


def _smoke_run(directory: Path) -> dict:
    """The smoke run, a child process (TRITON_INTERPRET=1 from its start) beside the other tests (tests/conftest.py,
    `background`)."""
    return {"args": [sys.executable, "benchmarks/decode_attention_kernels.py", "--smoke",
                     "--json", str(directory / "kernels.jsonl")],
            "cwd": ROOT, "timeout": 300, "env": {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}}


@pytest.mark.slow  # ~10 s: the interpreter runs each program of each variant in Python
@pytest.mark.background(command=_smoke_run)
def test_smoke_run_checks_every_variant_and_writes_its_json(background_run):
    (result,), directory = background_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    lines = [json.loads(line) for line in (directory / "kernels.jsonl").read_text().splitlines()]
    assert lines[0]["metric"] == "setup" and lines[-1]["metric"] == "summary" and lines[-1]["failed"] == 0
    rows = [line for line in lines if line["metric"] == "decode_attention"]
    # no flash on a CPU; the grid (1 split x 2 blocks x 1 warps), a num_stages, a cap, heads first; shared, capped
    assert {row["variant"] for row in rows} == {
        "split_kv s32 b16 w4", "split_kv s32 b32 w4", "split_kv stages2", "split_kv max_splits1",
        "split_kv heads_first", "split_kv_shared", "split_kv_shared max_splits1"}
    assert all(row["max_abs_err"] <= 1e-4 and row["us"] > 0 and row["bytes"] > 0 for row in rows)
    assert "| split_kv_shared max_splits1 |" in result.stdout  # the markdown table

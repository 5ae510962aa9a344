"""benchmarks/vllm_decode.py: its engine overrides (`--engine KEY=VALUE`), read before vLLM is imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "vllm_decode.py"
sys.path.insert(0, str(BENCHMARKS))

from vllm_decode import engine_override  # noqa: E402


@pytest.mark.parametrize(("text", "pair"), [
    ("max_num_batched_tokens=32768", ("max_num_batched_tokens", 32768)),
    ("enforce_eager=true", ("enforce_eager", True)),
    ('compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}',
     ("compilation_config", {"cudagraph_mode": "FULL_DECODE_ONLY"})),
    ("attention_backend=FLASHINFER", ("attention_backend", "FLASHINFER")),  # not JSON: kept as a string
    ("kv_cache_dtype=", ("kv_cache_dtype", "")),
])
def test_an_engine_override_is_read_as_json_where_it_parses(text, pair):
    assert engine_override(text) == pair


@pytest.mark.parametrize("bad", ["max_num_seqs", "=3"])
def test_a_malformed_override_is_a_one_line_usage_error(bad):
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", "unused", "--engine", bad],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "expected KEY=VALUE" in result.stderr and "Traceback" not in result.stderr


def test_an_unknown_model_runner_is_a_one_line_usage_error():
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", "unused", "--model-runner", "v3"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "--model-runner: invalid choice" in result.stderr and "Traceback" not in result.stderr

"""benchmarks/vllm_decode.py: its engine overrides (`--engine KEY=VALUE`), read before vLLM is imported."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vllm_decode.py"


def load_script():
    spec = importlib.util.spec_from_file_location("vllm_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("text", "pair"), [
    ("max_num_batched_tokens=32768", ("max_num_batched_tokens", 32768)),
    ("enforce_eager=true", ("enforce_eager", True)),
    ('compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}',
     ("compilation_config", {"cudagraph_mode": "FULL_DECODE_ONLY"})),
    ("attention_backend=FLASHINFER", ("attention_backend", "FLASHINFER")),  # not JSON: kept as a string
    ("kv_cache_dtype=", ("kv_cache_dtype", "")),
])
def test_an_engine_override_is_read_as_json_where_it_parses(text, pair):
    assert load_script().engine_override(text) == pair


@pytest.mark.parametrize("bad", ["max_num_seqs", "=3"])
def test_a_malformed_override_is_a_one_line_usage_error(bad):
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", "unused", "--engine", bad],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "expected KEY=VALUE" in result.stderr and "Traceback" not in result.stderr

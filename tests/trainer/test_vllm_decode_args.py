"""benchmarks/vllm_decode.py: its engine overrides (`--engine KEY=VALUE`), read before vLLM is imported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "vllm_decode.py"
sys.path.insert(0, str(BENCHMARKS))

import vllm_decode  # noqa: E402
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


def _usage_error(monkeypatch, capsys, *args: str) -> str:
    """The script's main() with these arguments, in this process (vLLM, imported only after the arguments are
    read, is not installed here: an import before the check would fail otherwise); its stderr after exit 2."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    with pytest.raises(SystemExit) as exit_info:
        vllm_decode.main()
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("bad", ["max_num_seqs", "=3"])
def test_a_malformed_override_is_a_one_line_usage_error(bad, monkeypatch, capsys):
    assert "expected KEY=VALUE" in _usage_error(monkeypatch, capsys, "--model", "unused", "--engine", bad)


def test_an_unknown_model_runner_is_a_one_line_usage_error(monkeypatch, capsys):
    err = _usage_error(monkeypatch, capsys, "--model", "unused", "--model-runner", "v3")
    assert "--model-runner: invalid choice" in err

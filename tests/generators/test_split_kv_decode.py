"""The Triton split-KV decode attention (split_kv_decode.py, `generator.decode_attention=split_kv`): on CPU, the
kernels under Triton's interpreter (interpreted_split_kv.py, in a child pytest); the setting's resolution and
errors; on a GPU, the compiled kernels and the CUDA-graph decoder."""

from __future__ import annotations

import copy
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import interpreted_split_kv
import pytest
import torch
from interpreted_split_kv import SHAPES, decode_inputs, generations  # the same inputs and decoder runs

from SPA_agent.generators import SamplingParams, split_kv_decode
from SPA_agent.generators.static_decode import StaticDecoder, masked_decode

pytestmark = pytest.mark.skipif(not split_kv_decode.available(), reason="needs triton (pip install triton)")

INTERPRETED = Path(__file__).with_name("interpreted_split_kv.py")


#: the tests below that run interpreted_split_kv.py's tests of a marker (`slow` or not) in the child pytest
INTERPRETED_TESTS = {"test_kernels_under_the_interpreter_equal_the_masked_reference": "not slow",
                     "test_decoder_under_the_interpreter_samples_what_its_cpu_attention_samples": "slow"}
REPORT = "report.xml"


def _interpreted(directory: Path, tests: list[tuple[str, dict]]) -> dict:
    """interpreted_split_kv.py's tests in one child pytest with TRITON_INTERPRET=1 from its start (one interpreter
    start for both tests below; the markers of those selected in this session), beside the other tests
    (tests/conftest.py, `background`); a junit report of its outcomes in `directory`."""
    markers = sorted({INTERPRETED_TESTS[name] for name, _ in tests})
    return {"args": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                     "-m", " or ".join(f"({m})" for m in markers), f"--junitxml={directory / REPORT}",
                     str(INTERPRETED)],
            "env": {**os.environ, "TRITON_INTERPRET": "1"}, "cwd": INTERPRETED.parents[2], "timeout": 900}


def interpreted_outcomes(background_run) -> dict[str, list[str]]:
    """The outcomes of each child test (`passed`, `failed`, `error` or `skipped`, one per parametrization), and the
    child's output under "output"."""
    (result,), directory = background_run
    report = directory / REPORT
    outcomes = {"output": [result.stdout[-6000:] + result.stderr[-3000:]]}
    for case in ET.parse(report).getroot().iter("testcase") if report.exists() else ():
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        outcomes.setdefault(case.get("name").split("[")[0], []).append(outcome.replace("failure", "failed"))
    return outcomes


def assert_interpreted_tests_passed(outcomes: dict[str, list[str]], marker: str) -> None:
    """Every test of interpreted_split_kv.py under `marker` ran in the child pytest, each case passed, none skipped."""
    names = [name for name, test in vars(interpreted_split_kv).items() if name.startswith("test_")
             and ("slow" in [mark.name for mark in getattr(test, "pytestmark", [])]) == (marker == "slow")]
    assert names and all(outcomes.get(name) and set(outcomes[name]) == {"passed"} for name in names), (
        {name: outcomes.get(name) for name in names}, outcomes["output"][0])


@pytest.mark.background(command=_interpreted)
def test_kernels_under_the_interpreter_equal_the_masked_reference(background_run):
    assert_interpreted_tests_passed(interpreted_outcomes(background_run), "not slow")


@pytest.mark.slow
@pytest.mark.background(command=_interpreted)
def test_decoder_under_the_interpreter_samples_what_its_cpu_attention_samples(background_run):
    assert_interpreted_tests_passed(interpreted_outcomes(background_run), "slow")


def test_unsupported_head_sizes_and_layouts_are_one_line_errors():
    query, key, value, kv_lengths = decode_inputs(2, 4, 2, 24, 40)
    with pytest.raises(ValueError, match="power-of-two head size of at least 16, got 24"):
        split_kv_decode.split_kv_decode(query, key, value, kv_lengths)
    query, key, value, kv_lengths = decode_inputs(2, 4, 2, 32, 40)
    with pytest.raises(ValueError, match="keys and values of one layout"):
        split_kv_decode.split_kv_decode(query, key, value.transpose(1, 2).contiguous().transpose(1, 2), kv_lengths)
    with pytest.raises(ValueError, match=r"decode attention must be one of \('flash', 'split_kv', 'split_kv_shared'\), "
                                         r"got 'paged'"):
        StaticDecoder(torch.nn.Linear(1, 1), stop_ids=[0], pad_id=0, attention="paged")


def test_launch_parameters_the_kernels_cannot_run_are_one_line_errors():
    for params, message in [(dict(block_n=48), "block_n must be a power of two of at least 16, got 48"),
                            (dict(block_n=8), "block_n must be a power of two of at least 16, got 8"),
                            (dict(split=96, block_n=64), "split must be a positive multiple of block_n=64, got 96"),
                            (dict(split=32, block_n=64), "split must be a positive multiple of block_n=64, got 32"),
                            (dict(num_warps=3), "num_warps must be a power of two, got 3"),
                            (dict(max_splits=0), "max_splits must be at least 1"),
                            (dict(num_stages=0), "num_stages must be at least 1")]:
        with pytest.raises(ValueError, match=message):
            split_kv_decode.launch_options(**params)
    assert split_kv_decode.launch_options() == (256, 64, None, {"num_warps": 4})  # the decoder's
    assert split_kv_decode.launch_options(128, 32, 8, 2, 4) == (128, 32, 4, {"num_warps": 8, "num_stages": 2})


def test_the_grid_follows_the_buffer_length_unless_capped():
    """Programs per (row, key/value head): one per SPLIT keys of the buffer (a kept buffer of 4,096 keys launches 16
    whatever the rows' lengths: CUDA graphs fix the grid), at most max_splits."""
    assert [split_kv_decode.grid_splits(length, 256, None) for length in (1, 256, 257, 832, 4096)] == [1, 1, 2, 4, 16]
    assert [split_kv_decode.grid_splits(length, 256, 4) for length in (257, 832, 4096)] == [2, 4, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("launch", [dict(split=128, block_n=32, num_warps=2, num_stages=2),
                                    dict(split=512, block_n=128, num_warps=8), dict(max_splits=2, heads_first=True)],
                         ids=["s128_b32_w2_st2", "s512_b128_w8", "capped_heads_first"])
def test_kernels_on_gpu_with_other_launch_parameters_equal_the_masked_reference(launch):
    query, key, value, kv_lengths = decode_inputs(*SHAPES[0], device="cuda", dtype=torch.bfloat16)
    output = split_kv_decode.split_kv_decode(query, key, value, kv_lengths, scaling=0.125, **launch)
    reference = masked_decode(query.float(), key.float(), value.float(), kv_lengths, scaling=0.125)
    torch.testing.assert_close(output.float(), reference, atol=2e-2, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES[:2], ids=["smollm2", "qwen0.5b"])  # their 9/3 and 14/2 heads
def test_kernels_on_gpu_equal_the_masked_reference(shape):
    query, key, value, kv_lengths = decode_inputs(*shape, device="cuda", dtype=torch.bfloat16)
    output = split_kv_decode.split_kv_decode(query, key, value, kv_lengths, scaling=0.125)
    reference = masked_decode(query.float(), key.float(), value.float(), kv_lengths, scaling=0.125)
    torch.testing.assert_close(output.float(), reference, atol=2e-2, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the compiled kernels need a CUDA GPU")
def test_cuda_graph_decoder_on_gpu_samples_what_the_masked_attention_samples(varied_model, tiny_tokenizer,
                                                                             prompts_of_lengths):
    """float32 on the GPU (the kernels' products in IEEE float32), every decode step a CUDA-graph replay: the same
    greedy tokens and finish reasons as the masked attention, which float32 decoding runs."""
    model = copy.deepcopy(varied_model).to("cuda")
    prompts = prompts_of_lengths([1, 2, 3, 5, 8, 12, 20, 40])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    assert (generations(model, tiny_tokenizer, prompts, greedy, "split_kv")
            == generations(model, tiny_tokenizer, prompts, greedy, "flash"))


def test_the_auto_settings_pick_the_triton_kernels_on_a_cuda_device_with_triton(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(split_kv_decode, "available", lambda: True)
    assert split_kv_decode.resolve("auto", cuda) == "split_kv"
    assert split_kv_decode.resolve("auto_shared", cuda) == "split_kv_shared"
    monkeypatch.setattr(split_kv_decode, "available", lambda: False)
    assert split_kv_decode.resolve("auto_shared", cuda) == "flash"


def test_setting_resolves_per_device_and_unknown_ones_are_refused_before_any_model():
    from SPA_agent.config import compose
    from SPA_agent.trainer.config_checks import check_config

    cpu = torch.device("cpu")
    assert split_kv_decode.resolve("auto", cpu) == "flash" and split_kv_decode.resolve("flash", cpu) == "flash"
    assert split_kv_decode.resolve("auto_shared", cpu) == "flash"  # SmolLM2's preset still decodes on a CPU
    with pytest.raises(ValueError, match="decode_attention=split_kv needs triton and a CUDA GPU; set generator"):
        split_kv_decode.resolve("split_kv", cpu)
    check_config(compose("_2_sokoban", ["model=tiny"]))  # its default: auto
    with pytest.raises(ValueError, match=r"generator.decode_attention must be one of \('auto', 'auto_shared', 'flash', "
                                         r"'split_kv', 'split_kv_shared'\), got 'paged'"):
        check_config(compose("_2_sokoban", ["model=tiny", "generator.decode_attention=paged"]))

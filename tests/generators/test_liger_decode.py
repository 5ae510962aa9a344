"""generator.liger_kernels: Liger's fused kernels in the GPU decoding model only (liger_decode.py)."""

from __future__ import annotations

import copy
import importlib
import importlib.util

import pytest
import torch

from SPA_agent.generators import SamplingParams, liger_decode
from SPA_agent.generators.hf import HFGenerator

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def test_cpu_decoding_keeps_transformers_modules(varied_model, tiny_tokenizer, prompts_of_lengths):
    """On CPU the flag changes nothing: no module is rebound and the samples are those of the plain generator."""
    model = copy.deepcopy(varied_model)
    norm_forward = type(model.model.norm).forward
    generator = HFGenerator(model, tiny_tokenizer, GREEDY, progress=False, liger_kernels=True)
    assert not generator.liger_kernels
    assert "forward" not in vars(model.model.norm) and type(model.model.norm).forward is norm_forward
    prompts = prompts_of_lengths([1, 3, 8])
    plain = HFGenerator(varied_model, tiny_tokenizer, GREEDY, progress=False).generate(prompts)
    assert [g.token_ids for g in generator.generate(prompts)] == [g.token_ids for g in plain]


def test_setting_is_true_false_or_auto_and_off_on_cpu(varied_model):
    for setting in (True, False, "auto", "true"):
        assert liger_decode.resolve(setting, varied_model) is False  # a CPU model
    with pytest.raises(ValueError, match="generator.liger_kernels must be true, false or auto, got 'yes'"):
        liger_decode.resolve("yes", varied_model)


def test_check_names_the_unsupported_model_and_the_missing_package(varied_model, monkeypatch):
    other = copy.deepcopy(varied_model)
    other.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="supports llama and qwen2 models, not 'gpt2'; set generator.liger_kernels=false"):
        liger_decode.check_liger(other)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"needs the liger-kernel package \(pip install -e '\.\[liger\]'\)"):
        liger_decode.check_liger(varied_model)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                    reason="Liger's Triton kernels need a CUDA GPU and the liger-kernel package")
def test_liger_decoding_gives_the_plain_greedy_tokens_on_gpu(varied_model, tiny_tokenizer, prompts_of_lengths):
    """float32 on the GPU, static decoder in CUDA graphs: the fused kernels give the same greedy tokens as
    transformers' modules, and transformers' rotary function is back once the generator returns."""
    module = importlib.import_module(liger_decode.MODEL_MODULES[varied_model.config.model_type])
    rope = module.apply_rotary_pos_emb
    prompts = prompts_of_lengths([1, 2, 3, 5, 8, 12, 20, 40])
    plain_model = copy.deepcopy(varied_model).to("cuda")
    fused_model = copy.deepcopy(varied_model).to("cuda")
    fused = HFGenerator(fused_model, tiny_tokenizer, GREEDY, progress=False, decoder="static", liger_kernels=True)
    assert fused.liger_kernels and "forward" in vars(fused_model.model.norm)
    fused_ids = [g.token_ids for g in fused.generate(prompts)]
    assert module.apply_rotary_pos_emb is rope
    plain = HFGenerator(plain_model, tiny_tokenizer, GREEDY, progress=False, decoder="static").generate(prompts)
    assert fused_ids == [g.token_ids for g in plain]


def test_ppo_config_check_refuses_an_unknown_setting_before_any_model():
    from SPA_agent.config import compose
    from SPA_agent.trainer.config_checks import check_config

    check_config(compose("_2_sokoban", ["model=smollm2-135m"]))  # its preset: auto
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.use_liger must be one of \(True, False, 'auto'\), got 'on'"):
        check_config(compose("_2_sokoban", ["model=tiny", "actor_rollout_ref.model.use_liger=on"]))

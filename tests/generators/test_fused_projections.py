"""generator.fused_projections (fused_projections.py): one GEMM for q/k/v and one for gate/up in the generation model.

On CPU: a fused model's logits and greedy tokens are the unfused model's (the tiny Qwen2 model with q/k/v biases and a
tiny Llama model without), its parameter names and addresses stay, weight copies by name reach the fused GEMMs, and
autograd runs transformers' forward; the setting's resolution and errors; the Triton kernels under Triton's
interpreter (interpreted_fused_projections.py, in a child pytest). On a GPU (`-k gpu`): bf16 decoding with kept CUDA
graphs against the unfused model."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import interpreted_fused_projections
import pytest
import torch
from test_split_kv_decode import interpreted_outcomes

from SPA_agent.generators import SamplingParams, fused_projections, split_kv_decode, static_decode
from SPA_agent.generators.hf import HFGenerator
from SPA_agent.trainer.local_backend.models import copy_weights

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
INTERPRETED = Path(__file__).with_name("interpreted_fused_projections.py")


def fused_copy(model):
    fused = copy.deepcopy(model)
    fused_projections.fuse_projections(fused)
    return fused


def fresh_model(model, seed: int):
    """Another random initialisation of `model`'s architecture, in its dtype and on its device."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = AutoModelForCausalLM.from_config(model.config)
    return fresh.to(next(model.parameters()).device, next(model.parameters()).dtype).eval()


def tiny_llama():
    """A tiny random Llama (SmolLM2's architecture: no q/k/v biases), 3 query heads per key/value head."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=860, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, initializer_range=0.2, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


def logits(model, batch: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=batch, attention_mask=mask).logits


def prompt_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) (4, 20), left padded to different lengths."""
    batch = torch.randint(0, 850, (4, 20), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(20) >= torch.tensor([0, 3, 9, 15])[:, None]).long()
    return batch, mask


@pytest.mark.parametrize("architecture", ["qwen2_biases", "llama"])
def test_fused_model_gives_the_unfused_logits_and_keeps_its_parameters(varied_model, architecture):
    model = varied_model if architecture == "qwen2_biases" else tiny_llama()
    fused = fused_copy(model)
    assert [name for name, _ in fused.named_parameters()] == [name for name, _ in model.named_parameters()]
    attention = fused.model.layers[0].self_attn
    assert attention.q_proj.weight.data_ptr() == attention.fused_weight.data_ptr()
    assert (attention.fused_bias is not None) == (architecture == "qwen2_biases")
    batch, mask = prompt_batch()
    torch.testing.assert_close(logits(fused, batch, mask), logits(model, batch, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("architecture", ["qwen2_biases", "llama"])
def test_weight_copies_by_name_reach_the_fused_gemms_at_the_same_addresses(varied_model, architecture):
    """What the PPO backend does to its rollout copy every step (`copy_weights`): the fused model then computes the
    new weights' logits, and no parameter moved (the kept decode graphs read them where they were captured)."""
    model = varied_model if architecture == "qwen2_biases" else tiny_llama()
    fused = fused_copy(model)
    addresses = [t.data_ptr() for t in fused.parameters()]
    fresh = fresh_model(model, seed=1)
    copy_weights(fused, fresh.named_parameters())
    assert [t.data_ptr() for t in fused.parameters()] == addresses
    batch, mask = prompt_batch(seed=1)
    torch.testing.assert_close(logits(fused, batch, mask), logits(fresh, batch, mask), rtol=1e-5, atol=1e-5)


def test_fused_model_decodes_the_unfused_greedy_tokens_with_the_static_decoder(varied_model, tiny_tokenizer,
                                                                                prompts_of_lengths):
    prompts = prompts_of_lengths([1, 3, 8, 20])
    fused = HFGenerator(fused_copy(varied_model), tiny_tokenizer, GREEDY, decoder="static", progress=False,
                        batch_size=None)
    plain = HFGenerator(varied_model, tiny_tokenizer, GREEDY, decoder="static", progress=False, batch_size=None)
    assert [g.token_ids for g in fused.generate(prompts)] == [g.token_ids for g in plain.generate(prompts)]


def test_with_autograd_the_fused_model_trains_through_transformers_forward(varied_model):
    """Gradients reach q/k/v and gate/up as in the unfused model (the fused forwards run only without autograd)."""
    model, fused = copy.deepcopy(varied_model), fused_copy(varied_model)
    batch, mask = prompt_batch()
    for each in (model, fused):
        each(input_ids=batch, attention_mask=mask).logits.logsumexp(-1).mean().backward()
    gradients = dict(model.named_parameters())
    for name, parameter in fused.named_parameters():
        torch.testing.assert_close(parameter.grad, gradients[name].grad, rtol=1e-5, atol=1e-6)


def test_setting_is_true_false_or_auto_and_off_on_cpu(varied_model, tiny_tokenizer):
    """As generator.liger_kernels: nothing changes on CPU whatever the setting; other values are one-line errors."""
    for setting in (True, False, "auto", "true"):
        assert fused_projections.resolve(setting, varied_model) is False  # a CPU model
    model = copy.deepcopy(varied_model)
    generator = HFGenerator(model, tiny_tokenizer, GREEDY, progress=False, fused_projections=True)
    assert not generator.fused_projections and "forward" not in vars(model.model.layers[0].self_attn)
    with pytest.raises(ValueError, match="^generator.fused_projections must be true, false or auto, got 'yes'$"):
        fused_projections.resolve("yes", varied_model)


def test_unsupported_models_are_named(varied_model):
    other = copy.deepcopy(varied_model)
    other.config.model_type = "gpt2"
    assert fused_projections.unsupported(other) == "supports llama and qwen2 models, not 'gpt2'"
    with pytest.raises(ValueError, match="^fuse_projections supports llama and qwen2 models, not 'gpt2'$"):
        fused_projections.fuse_projections(other)
    other = copy.deepcopy(varied_model)
    other.config.hidden_act = "gelu"
    assert fused_projections.unsupported(other) == "fuses SiLU MLPs, not 'gelu'"


def test_config_default_is_false_and_the_ppo_check_refuses_other_values():
    from SPA_agent.config import compose
    from SPA_agent.trainer.config_checks import check_config

    cfg = compose("_2_sokoban", ["model=tiny"])
    assert cfg.generator.fused_projections is False
    check_config(compose("_2_sokoban", ["model=tiny", "generator.fused_projections=auto"]))
    with pytest.raises(ValueError, match=r"generator.fused_projections must be one of \(True, False, 'auto'\), got 'on'"):
        check_config(compose("_2_sokoban", ["model=tiny", "generator.fused_projections=on"]))


def _interpreted(directory: Path) -> dict:
    """interpreted_fused_projections.py in a child pytest with TRITON_INTERPRET=1 from its start; a junit report in
    `directory` (read by test_split_kv_decode.interpreted_outcomes)."""
    return {"args": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                     f"--junitxml={directory / 'report.xml'}", str(INTERPRETED)],
            "env": {**os.environ, "TRITON_INTERPRET": "1"}, "cwd": INTERPRETED.parents[2], "timeout": 300}


@pytest.mark.skipif(not split_kv_decode.available(), reason="needs triton (pip install triton)")
@pytest.mark.background(command=_interpreted)
def test_kernels_under_the_interpreter_equal_their_torch_references(background_run):
    """Every test of interpreted_fused_projections.py ran in the child pytest and each case passed."""
    outcomes = interpreted_outcomes(background_run)
    names = [name for name in vars(interpreted_fused_projections) if name.startswith("test_")]
    assert names and all(outcomes.get(name) and set(outcomes[name]) == {"passed"} for name in names), (
        {name: outcomes.get(name) for name in names}, outcomes["output"][0])


def recorded_logits(generator, prompts, monkeypatch) -> list[torch.Tensor]:
    """The float32 logits each sampling step of `generator.generate(prompts)` sees (the prefill's, then each decode
    step's), copied to the host."""
    seen = []
    sample = static_decode.sample

    def recording(logits, params, rng):
        seen.append(logits.float().cpu())
        return sample(logits, params, rng)

    monkeypatch.setattr(static_decode, "sample", recording)
    generator.generate(prompts)
    monkeypatch.setattr(static_decode, "sample", sample)
    return seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels and CUDA graphs need a CUDA GPU")
def test_fused_decoding_with_kept_graphs_on_gpu(varied_model, tiny_tokenizer, prompts_of_lengths, monkeypatch):
    """On a GPU, with Liger's kernels where installed and kept CUDA graphs: float32 greedy tokens are the unfused
    model's, also after a weight copy by name (replayed graphs, no new capture); in bf16 the first decode step's
    logits are as close to the float32 model's as the unfused bf16 model's are (within twice their error)."""
    def generator(model, **settings):
        return HFGenerator(model, tiny_tokenizer, GREEDY, decoder="static", progress=False, batch_size=None,
                           keep_decode_graphs=True, liger_kernels="auto", **settings)

    prompts = prompts_of_lengths([1, 2, 3, 5, 8, 12, 20, 40])
    model = copy.deepcopy(varied_model).to("cuda")
    fused = generator(model, fused_projections=True)
    plain = generator(copy.deepcopy(varied_model).to("cuda"))
    assert fused.fused_projections and "forward" in vars(model.model.layers[0].mlp)
    for _ in range(2):
        assert [g.token_ids for g in fused.generate(prompts)] == [g.token_ids for g in plain.generate(prompts)]
    fresh = fresh_model(model, seed=1)
    copy_weights(model, fresh.named_parameters())
    copy_weights(plain.model, fresh.named_parameters())
    assert [g.token_ids for g in fused.generate(prompts)] == [g.token_ids for g in plain.generate(prompts)]
    assert fused._static.last_capture_s == 0.0  # a kept graph replayed over the copied weights
    reference = recorded_logits(generator(copy.deepcopy(varied_model).to("cuda")), prompts, monkeypatch)
    bf16 = [recorded_logits(generator(copy.deepcopy(varied_model).to("cuda", torch.bfloat16), **settings), prompts,
                            monkeypatch) for settings in ({}, {"fused_projections": True})]
    same_start = torch.stack([steps[0].argmax(-1) for steps in (reference, *bf16)]).eq(reference[0].argmax(-1)).all(0)
    errors = [float((steps[1] - reference[1])[same_start].abs().max()) for steps in bf16]
    assert same_start.sum() >= len(prompts) // 2, "bf16 changed most first tokens: no decode step to compare"
    assert errors[1] <= max(2 * errors[0], 0.05), f"fused bf16 error {errors[1]:.4f}, unfused {errors[0]:.4f}"

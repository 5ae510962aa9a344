"""actor_rollout_ref.model.liger_training: Liger's fused RMSNorm, SwiGLU and rotary kernels in the local backend's
training passes (actor, critic, reference) on a CUDA GPU, through liger_decode.fused_kernels for each pass.

CPU (CI): the config check's errors, `auto`/`true` change nothing on a CPU, and the switch reaches every pass (Liger's
kernels replaced by recording stand-ins that compute what transformers' modules do). GPU (`pytest -k gpu`, skipped
without CUDA and liger-kernel): the fused passes equal the plain ones, tightly in float32, loosely under bf16 autocast.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import types

import pytest
import torch

from SPA_agent.config import compose
from SPA_agent.generators import liger_decode
from SPA_agent.trainer.config_checks import check_config
from SPA_agent.trainer.local_backend import models as lm
from SPA_agent.trainer.local_backend.backend import LIGER_TRAINING, LocalBackend

GPU_LIGER = torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None
needs_gpu_liger = pytest.mark.skipif(not GPU_LIGER, reason="Liger's Triton kernels need a CUDA GPU and liger-kernel")
#: gradient checkpointing on (its recomputation runs in the backward pass) and a reference model
CHECKPOINTED = ("actor_rollout_ref.model.enable_gradient_checkpointing=True",
                "critic.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.use_ref=True",
                "actor_rollout_ref.actor.use_kl_loss=True", "ppo_mini_batch_size=3")


def _training_batch(backend: LocalBackend, batch, run=lambda method, batch: method(batch)) -> tuple:
    """Every pass of a PPO step on `batch` (each called as `run(backend method, batch)`): (old log-probs,
    entropies, reference log-probs, values, update metrics)."""
    batch.batch["response_mask"] = batch.batch["loss_mask"]
    old = run(backend.compute_log_prob, batch)
    ref = run(backend.compute_ref_log_prob, batch)
    values = run(backend.compute_values, batch)
    batch = batch.union(old).union(ref).union(values)
    shape = batch.batch["loss_mask"].shape
    batch.batch["advantages"] = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    batch.batch["returns"] = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    metrics = {**run(backend.update_critic, batch), **run(backend.update_actor, batch)}
    return (old.batch["old_log_probs"], old.batch["entropys"], ref.batch["ref_log_prob"], values.batch["values"],
            metrics)


def _assert_same_step(plain: tuple, fused: tuple, rtol: float) -> None:
    for a, b in zip(plain[:4], fused[:4]):
        torch.testing.assert_close(b, a, rtol=rtol, atol=rtol)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss",
                "critic/grad_norm"):
        assert abs(plain[4][key] - fused[4][key]) <= rtol * max(1.0, abs(plain[4][key])), key


# ---------------------------------------------------------------- config and resolution


def test_off_by_default_and_the_config_check_refuses_other_values():
    cfg = compose("_2_sokoban", ["model=tiny"])
    assert cfg.actor_rollout_ref.model.liger_training is False
    for setting in ("true", "false", "auto"):
        check_config(compose("_2_sokoban", ["model=tiny", f"{LIGER_TRAINING}={setting}"]))
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.liger_training must be one of "
                                         r"\(True, False, 'auto'\), got 'on'$"):
        check_config(compose("_2_sokoban", ["model=tiny", f"{LIGER_TRAINING}=on"]))


def test_the_verl_backend_refuses_true():
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.liger_training=true is the local backend's "
                                         r"switch; the verl backend's workers do not read it: set "
                                         r"actor_rollout_ref.model.liger_training=false$"):
        check_config(compose("_2_sokoban", ["model=tiny", "trainer.backend=verl", f"{LIGER_TRAINING}=true"]))


def test_resolution_names_the_training_key(tiny_model, monkeypatch):
    for setting in (True, False, "auto"):
        assert liger_decode.resolve(setting, tiny_model, LIGER_TRAINING) is False  # a CPU model
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.liger_training must be true, false or auto, "
                                         r"got 'yes'$"):
        liger_decode.resolve("yes", tiny_model, LIGER_TRAINING)
    other = copy.deepcopy(tiny_model)
    other.config.model_type = "gpt2"
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.liger_training=true supports llama and qwen2 "
                                         r"models, not 'gpt2'; set actor_rollout_ref.model.liger_training=false$"):
        liger_decode.check_liger(other, LIGER_TRAINING)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.liger_training=true needs the liger-kernel "
                                         r"package \(pip install -e '\.\[liger\]'\) or "
                                         r"actor_rollout_ref.model.liger_training=false$"):
        liger_decode.check_liger(tiny_model, LIGER_TRAINING)


def test_on_cpu_auto_and_true_leave_the_passes_unchanged(ppo_config, tiny_tokenizer, make_batch):
    steps = {}
    for setting in ("false", "auto", "true"):
        torch.manual_seed(0)
        backend = LocalBackend(ppo_config("_2_sokoban", *CHECKPOINTED, f"{LIGER_TRAINING}={setting}"), tiny_tokenizer)
        assert backend.liger_models == []
        steps[setting] = _training_batch(backend, make_batch())
        assert "forward" not in vars(backend.actor.model.model.norm)
    for setting in ("auto", "true"):
        _assert_same_step(steps["false"], steps[setting], rtol=0.0)


# ---------------------------------------------------------------- the switch reaches every pass (CPU stand-ins)


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """Liger's patch and rotary swap replaced by stand-ins that call transformers' own code and record each call:
    {"norm": calls, "mlp": calls, "rope": calls, "open": whether the rotary swap is open, "settings": resolve's}."""
    seen = {"norm": 0, "mlp": 0, "rope": 0, "open": False, "settings": []}

    def resolve(setting, model, key):
        seen["settings"].append((setting, key))
        return setting is True

    def recording(kind, forward):
        def call(self, *args, **kwargs):
            assert seen["open"], f"a patched {kind} ran outside fused_kernels"
            seen[kind] += 1
            return forward(self, *args, **kwargs)
        return call

    def patch_model(model):
        norms, mlps = liger_decode._norms_and_mlps(model)
        for kind, modules in (("norm", norms), ("mlp", mlps)):
            for module in modules:
                module.forward = types.MethodType(recording(kind, type(module).forward), module)
                module.casting_mode = "stand-in"  # Liger sets attributes too; fused_kernels removes them after

    @contextlib.contextmanager
    def fused_rope(model):
        module = importlib.import_module(liger_decode.MODEL_MODULES[model.config.model_type])
        original = module.apply_rotary_pos_emb

        def rope(*args, **kwargs):
            seen["rope"] += 1
            return original(*args, **kwargs)

        module.apply_rotary_pos_emb, seen["open"] = rope, True
        try:
            yield
        finally:
            module.apply_rotary_pos_emb, seen["open"] = original, False

    monkeypatch.setattr(liger_decode, "resolve", resolve)
    monkeypatch.setattr(liger_decode, "patch_model", patch_model)
    monkeypatch.setattr(liger_decode, "fused_rope", fused_rope)
    return seen


@pytest.mark.parametrize("lora", [False, True])
def test_the_switch_reaches_every_pass_and_the_models_are_plain_after(stand_in_kernels, ppo_config, tiny_tokenizer,
                                                                     make_batch, lora):
    """Actor, reference (under LoRA: the actor without adapters) and critic run the patched modules and rotary
    function in their passes, backward recomputation (gradient checkpointing) included; outside, nothing is
    left of the patch (the generator's rollout copy is made from the plain actor). Same results."""
    extra = ("actor_rollout_ref.model.lora_rank=4", "critic.model.lora_rank=4") if lora else ()
    seen = stand_in_kernels
    steps = []
    for setting in ("false", "true"):
        cfg = ppo_config("_2_sokoban", *CHECKPOINTED, *extra, f"{LIGER_TRAINING}={setting}")
        torch.manual_seed(0)  # the same LoRA adapters
        backend = LocalBackend(cfg, tiny_tokenizer)
        norms, mlps = liger_decode._norms_and_mlps(backend.actor.model)
        before = [set(vars(module)) for module in (*norms, *mlps)]
        calls = {}  # backend method → patched (norm, mlp, rotary) calls in it

        def run(method, batch):
            start = (seen["norm"], seen["mlp"], seen["rope"])
            out = method(batch)
            calls[method.__name__] = tuple(seen[k] - n for k, n in zip(("norm", "mlp", "rope"), start))
            return out

        steps.append(_training_batch(backend, make_batch(), run))
        assert [set(vars(module)) for module in (*norms, *mlps)] == before
        if setting == "false":
            assert seen["settings"] == [(False, LIGER_TRAINING)] * (2 if lora else 3)
            assert set(calls.values()) == {(0, 0, 0)}
            continue
        assert backend.liger_models == [backend.actor.model, *([] if lora else [backend.ref]), backend.critic.model]
        layers = backend.actor.model.config.num_hidden_layers
        for name, (norm, mlp, rope) in calls.items():
            # one micro-batch a pass; the updates' backward passes re-run each layer (gradient checkpointing)
            runs = 2 if name.startswith("update") else 1
            assert (norm, mlp, rope) == (runs * 2 * layers + 1, runs * layers, runs * layers), name
    _assert_same_step(steps[0], steps[1], rtol=0.0)


# ---------------------------------------------------------------- GPU: fused passes == plain passes


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30)).item()


def _model_passes(model, critic: bool, micro: dict, packed: bool, fused: bool, bf16: bool) -> list[torch.Tensor]:
    """The outputs of the actor's (log-probs, entropies) or the critic's (values) training forward and the
    gradients of every parameter for a fixed random weighting of them."""
    model.zero_grad(set_to_none=True)
    kernels = liger_decode.fused_kernels(model) if fused else contextlib.nullcontext()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with kernels:
        with autocast:
            if critic:
                outputs = [lm.token_values(model, micro, packed=packed)]
            else:
                outputs = list(lm.token_log_probs(model, micro, 0.9, with_entropy=True, packed=packed))
        gen = torch.Generator("cuda").manual_seed(0)
        mask = micro["attention_mask"][:, 1:]
        loss = sum((out.float() * mask * torch.randn(out.shape, generator=gen, device="cuda")).sum()
                   for out in outputs)
        loss.backward()
    return [out.detach() * mask for out in outputs] + [p.grad.clone() for p in model.parameters()]


@needs_gpu_liger
@pytest.mark.parametrize("bf16, tolerance", [(False, 1e-5), (True, 5e-2)], ids=["float32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_fused_training_passes_equal_the_plain_ones_on_gpu(tiny_dir, make_batch, packed, bf16, tolerance):
    """The actor's log-probs and entropies, the critic's values and the gradients of every parameter, gradient
    checkpointing on: within 1e-5 (relative, each tensor) in float32 without autocast, 5e-2 under bf16 autocast."""
    from SPA_agent.trainer.packing import enable_packed_attention

    device = torch.device("cuda")
    module = importlib.import_module(liger_decode.MODEL_MODULES["qwen2"])
    rope = module.apply_rotary_pos_emb
    batch = make_batch(rows=4, length=40).batch
    micro = {key: batch[key].to(device) for key in lm.MODEL_INPUT_KEYS}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        critic = lm.load_critic(tiny_dir, device, gradient_checkpointing=True)
    for model, is_critic in ((lm.load_actor(tiny_dir, device, gradient_checkpointing=True), False), (critic, True)):
        model.train()
        if packed:
            enable_packed_attention(model)
        plain = _model_passes(model, is_critic, micro, packed, fused=False, bf16=bf16)
        fused = _model_passes(model, is_critic, micro, packed, fused=True, bf16=bf16)
        assert module.apply_rotary_pos_emb is rope and "forward" not in vars(model.model.norm)
        errors = [_relative_error(b, a) for a, b in zip(plain, fused)]
        print(type(model).__name__, "largest relative error", max(errors))
        assert max(errors) <= tolerance, errors
        assert all(torch.isfinite(t).all() for t in fused)


@needs_gpu_liger
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_ppo_step_with_liger_training_follows_the_plain_one_on_gpu(ppo_config, tiny_tokenizer, make_batch, lora):
    """The local backend on the GPU (bf16 autocast, packed micro-batches, gradient checkpointing, LoRA or not):
    every pass of a step with the switch on within bf16 rounding of the step with it off, and the generator's
    rollout copy made after the passes holds transformers' modules."""
    extra = ("actor_rollout_ref.model.lora_rank=4", "critic.model.lora_rank=4") if lora else ()
    steps = []
    for setting in ("false", "true"):
        cfg = ppo_config("_2_sokoban", *CHECKPOINTED, *extra, "trainer.device=cuda", "generator.liger_kernels=false",
                         f"{LIGER_TRAINING}={setting}")
        torch.manual_seed(0)
        backend = LocalBackend(cfg, tiny_tokenizer)
        assert len(backend.liger_models) == (0 if setting == "false" else 2 if lora else 3)
        steps.append(_training_batch(backend, make_batch(rows=3, length=24)))
        copy_ = lm.rollout_copy(backend.actor.model, torch.bfloat16)
        assert "forward" not in vars(copy_.model.norm) and "forward" not in vars(copy_.model.layers[0].mlp)
    _assert_same_step(steps[0], steps[1], rtol=5e-2)

"""Building the trained model: load, resize for added tokens, gradient checkpointing, FSDP2 (LoRA: runs/lora.py).

Every rank loads the same fp32 weights on the CPU; `fully_shard` then shards each decoder layer and the root
over the device mesh and moves the shards to the mesh's device. On GPU the forward and backward run in bf16
(`MixedPrecisionPolicy`), gradients are reduced in fp32, the optimizer keeps fp32 master weights. `place` does
that, or (a single rank by default, `trainer.fsdp=auto`) keeps a plain module under bf16 autocast.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

LORA_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.")


def load_model(path: str, cfg, vocab_size: int) -> torch.nn.Module:
    """fp32 causal LM from `path`, embeddings grown (never shrunk, unlike spec §12.18) to `vocab_size`.

    `attn_implementation=packed_sdpa` is the PPO trainer's packed attention (SPA_agent/trainer/packing.py): each
    packed sample attends to itself in one causal SDPA call (flash attention on GPU), found from the restarting
    position ids; no mask is built and nothing compiles, unlike flex attention's minutes on a fresh machine."""
    from transformers import AutoModelForCausalLM

    from SPA_agent.trainer.packing import avoid_cudnn_attention, enable_packed_attention

    packed = cfg.attn_implementation == "packed_sdpa"
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa" if packed else cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code)
    if packed:
        enable_packed_attention(model)
        avoid_cudnn_attention()
    if vocab_size > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(vocab_size)
    if cfg.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def shard(model: torch.nn.Module, mesh: DeviceMesh, bf16: bool) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer (the model's `_no_split_modules`), then the root."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer_names = set(getattr(base, "_no_split_modules", None) or [])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for module in model.modules():
        if type(module).__name__ in layer_names:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def place(model: torch.nn.Module, mesh: DeviceMesh | None, device: torch.device,
          fsdp: bool) -> tuple[torch.nn.Module, Callable[[], contextlib.AbstractContextManager]]:
    """The model ready to train on `device`, and the context its forward passes run in: sharded by `shard` (FSDP's
    mixed precision casts weights and inputs to bf16 on GPU), or with `fsdp` false a plain float32 module whose
    forward runs under bf16 autocast on GPU (as the PPO trainer's local backend): one rank has nothing to shard."""
    if fsdp:
        return shard(model, mesh, bf16=device.type == "cuda"), contextlib.nullcontext
    compute = functools.partial(torch.autocast, "cuda", torch.bfloat16) if device.type == "cuda" \
        else contextlib.nullcontext
    return model.to(device), compute


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict (a collective: every rank must call it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def trainable_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of `state` that are trained (the LoRA adapters)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def merged_hf_state_dict(state: dict[str, torch.Tensor], lora_scale: float | None) -> dict[str, torch.Tensor]:
    """Plain Hugging Face keys. With LoRA (keys `base_model.model.…`), merges W + scale · B @ A."""
    if lora_scale is None:
        return state
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if any(m in key for m in LORA_MARKERS):
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        prefix = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
        if prefix is not None and key.endswith(".weight") and f"{prefix}.lora_A.default.weight" in state:
            a, b = state[f"{prefix}.lora_A.default.weight"], state[f"{prefix}.lora_B.default.weight"]
            value = value + lora_scale * (b @ a)
        merged[name] = value
    return merged

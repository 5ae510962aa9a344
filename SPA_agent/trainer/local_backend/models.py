"""Hugging Face models of the `local` backend and their forward passes over a rollout batch.

Shapes: b trajectories in a micro-batch, T tokens per row; outputs are (b, T-1), aligned with
`responses = input_ids[:, 1:]` (column j is about token j+1, predicted from tokens ≤ j).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from verl import DataProto
from verl.utils import torch_functional as verl_F

from SPA_agent.trainer.local_backend import lora
from SPA_agent.trainer.packing import SEGMENTS_KWARG, PackedRows

#: the critic's value head: AutoModelForTokenClassification's `score` layer (one output per token)
VALUE_HEAD = "score"

#: batch keys a forward pass reads
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")
#: float32 logits the packed log-prob head holds at once (1 GiB): it projects a packed row onto the vocabulary
#: in chunks of LOGIT_ELEMENTS // vocab positions, recomputed in the backward pass, so the memory of a
#: micro-batch's logits does not grow with its token budget
LOGIT_ELEMENTS = 2**28


def autocast(device: torch.device, cache_enabled: bool = True) -> contextlib.AbstractContextManager:
    """bf16 autocast on GPU; plain float32 on CPU. Generation passes cache_enabled=False, which CUDA-graph
    capture (the hf generator's static decoder) requires."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16, cache_enabled=cache_enabled)
    return contextlib.nullcontext()


def load_actor(path: str, device: torch.device, gradient_checkpointing: bool) -> nn.Module:
    """The policy: AutoModelForCausalLM in float32 (bf16 compute comes from autocast)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    _set_gradient_checkpointing(model, gradient_checkpointing)
    return model


def load_critic(path: str, device: torch.device, gradient_checkpointing: bool) -> nn.Module:
    """The value model: the same checkpoint with a 1-output token-classification head, dropout 0 (spec §10.3).

    From a causal-LM checkpoint the head `score` is freshly initialised, by design: one line says so, in place of
    transformers' load report, whose "MISSING … consider training" table reads like a broken checkpoint. From a
    critic checkpoint the head is loaded.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # set after loading: unknown keyword arguments are dropped by from_pretrained
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32,
                                                                      output_loading_info=True)
    finally:
        logging.set_verbosity(verbosity)
    missing = sorted(info["missing_keys"])
    if missing and all(key.startswith(f"{VALUE_HEAD}.") for key in missing):
        print(f"critic: new value head ({', '.join(missing)}) initialised, as intended for a critic started from a "
              "language model", flush=True)
    elif missing:
        print(f"warning: the critic's weights {missing} are not in {path} and were initialised at random", flush=True)
    _set_gradient_checkpointing(model.to(device), gradient_checkpointing)
    return model


def load_reference(path: str, device: torch.device) -> nn.Module:
    """The frozen reference policy, bf16 on GPU, float32 on CPU."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    return model


def rollout_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen copy of the policy in `dtype` to generate with. Of a LoRA model, a plain model of the same
    architecture (and generation config) without adapters, to be filled with merged weights by `copy_weights`."""
    if not lora.is_lora(model):
        return copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
    from transformers import AutoModelForCausalLM

    base = model.get_base_model()
    with torch.device(next(base.parameters()).device):
        plain = AutoModelForCausalLM.from_config(base.config, dtype=dtype)
    plain.generation_config = copy.deepcopy(base.generation_config)
    return plain.eval().requires_grad_(False)


@torch.no_grad()
def copy_weights(target: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (Hugging Face name, tensor) pairs (`lora.generation_weights`) into `target`'s parameters, one at a
    time; names `target` does not hold as parameters (a tied head) are skipped, and every parameter must come."""
    params = dict(target.named_parameters())
    missing = set(params)
    for name, value in weights:
        if name in params:
            params[name].copy_(value)
            missing.discard(name)
    if missing:
        raise ValueError(f"no weights for {sorted(missing)[:3]} (of {len(missing)})")


def _set_gradient_checkpointing(model: nn.Module, enabled: bool) -> None:
    model.config.use_cache = False
    if enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def micro_batches(batch: DataProto, plan: list[list[int]], keys: tuple[str, ...], device: torch.device
                  ) -> Iterator[dict]:
    """One dict of the given tensors on `device` per micro-batch of `plan` (row indices, see packing.py).

    Each tensor goes to the device whole, once, and is indexed there: gathering the rows of a (256, ~3k) host
    tensor took milliseconds a key and micro-batch, about 1 s of host time a PPO step of SmolLM2 on an H200
    (benchmarks/RESULTS.md, "the training passes' profile")."""
    on_device = {key: batch.batch[key].to(device) for key in keys}
    for rows in plan:
        index = torch.tensor(rows, device=device)
        yield {key: on_device[key][index] for key in keys}


def _forward(model: nn.Module, micro: dict) -> torch.Tensor:
    inputs = {key: micro[key] for key in MODEL_INPUT_KEYS}
    return model(**inputs, use_cache=False).logits


def _packed_forward(model: nn.Module, packed: PackedRows) -> torch.Tensor:
    """Model output (1, L, ·) of a packed row (the model must use packing.enable_packed_attention)."""
    return model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                 **{SEGMENTS_KWARG: packed.segments}).logits


class _LogProbsAndEntropy(torch.autograd.Function):
    """log p(target) and the entropy H of softmax(logits) per row of float32 logits (n, V), with a closed-form
    backward pass: d log p_t / dz = onehot(t) - p and dH / dz = -p (z - E_p[z]) = -p (log p + H).

    At a 152k vocabulary the actor update spends most of its time in elementwise passes over (n, V) tensors;
    composing verl's `logprobs_from_logits` and `entropy_from_logits` under autograd makes about three times as
    many as this (one log-softmax forward, one fused expression backward). Values and gradients equal theirs
    (tests/trainer/test_local_models.py)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor):
        log_p = torch.log_softmax(logits, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(dim=-1)
        ctx.save_for_backward(log_p, targets, entropy)
        return log_p.gather(-1, targets[:, None])[:, 0], entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor):
        log_p, targets, entropy = ctx.saved_tensors
        grad = log_p.add(entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_log_probs[:, None])
        grad.mul_(log_p.exp()).neg_()
        return grad.scatter_add_(-1, targets[:, None], grad_log_probs[:, None]), None


def _head_log_probs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool) -> torch.Tensor:
    """(1 or 2, n): log-probs of `targets` (n,) under the temperature-scaled logits of `hidden` (n, H), and
    the entropies when asked."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    if with_entropy:
        return torch.stack(_LogProbsAndEntropy.apply(logits, targets))
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).T


def _packed_log_probs(model: nn.Module, rows: PackedRows, temperature: float, with_entropy: bool) -> torch.Tensor:
    """(1 or 2, L) log-probs of each packed token's successor (and entropies), the vocabulary projection in
    chunks of LOGIT_ELEMENTS (checkpointed when gradients are on)."""
    # get_decoder(): the backbone, also through a PEFT wrapper (which forwards the call; LoRA layers sit inside)
    hidden = model.get_decoder()(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False,
                                 **{SEGMENTS_KWARG: rows.segments}).last_hidden_state[0]  # (L, H)
    head = model.get_output_embeddings()
    targets = torch.roll(rows.input_ids[0], -1)
    chunk = max(1, LOGIT_ELEMENTS // head.out_features)
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        args = (head, hidden[start : start + chunk], targets[start : start + chunk], temperature, with_entropy)
        parts.append(checkpoint(_head_log_probs, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else _head_log_probs(*args))
    return torch.cat(parts, dim=1)


def token_log_probs(
    model: nn.Module, micro: dict, temperature: float, with_entropy: bool, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(input_ids[:, j+1] | ≤ j) from temperature-scaled logits, (b, T-1); and the entropy if asked.

    `packed`: the micro-batch runs as one padding-free row (packing.py); positions without a next token of the
    same trajectory (padding) are 0 instead of the padded path's values computed from padding.
    """
    if packed:
        rows = PackedRows.pack(micro)
        out = _packed_log_probs(model, rows, temperature, with_entropy)
        keep = rows.next_token_positions()
        return rows.unpack(out[0], keep), (rows.unpack(out[1], keep) if with_entropy else None)
    logits = _forward(model, micro)[:, :-1].float() / temperature
    log_probs = verl_F.logprobs_from_logits(logits, micro["input_ids"][:, 1:])
    entropy = verl_F.entropy_from_logits(logits) if with_entropy else None
    return log_probs, entropy


def token_values(model: nn.Module, micro: dict, packed: bool = False) -> torch.Tensor:
    """V(state ≤ j) from the value head, (b, T-1), float32 (`packed`: padding positions are 0)."""
    if packed:
        rows = PackedRows.pack(micro)
        values = _packed_forward(model, rows)[0, :, 0].float()
        return rows.unpack(values, rows.cols < rows.shape[1] - 1)
    return _forward(model, micro)[:, :-1, 0].float()

"""Padding-free micro-batches for the `local` backend: token-budget plans and packed rows.

A rollout batch is (B, T), left padded. Two independent choices (verl's names):

- the *plan* (`use_dynamic_bsz`): which rows share a micro-batch — consecutive groups of
  `*_micro_batch_size_per_gpu` rows, or bins of at most `*_max_token_len_per_gpu` real tokens (first-fit
  decreasing, `SPA_agent.runs.bin_packing`, as the SFT packer);
- the *layout* (`use_remove_padding`): a micro-batch runs either as its padded (b, T) rows or as one packed row
  (1, L) of the rows' real tokens back to back, each keeping its own `position_ids`.

Packed rows run through `packed_sdpa_attention`: per layer, causal attention of each trajectory over its own
tokens, so no token attends across a trajectory boundary and no (L, L) mask is computed over. On a CUDA GPU in
bf16/fp16 that is one variable-length flash-attention call for the whole row (`varlen_flash_attention`), elsewhere
one SDPA call per trajectory (the same attention; the loop cost a SmolLM2 PPO step on an H200 ~64 calls a layer
and pass, with their slices, concatenations and backward copies). Outputs are
scattered back to the padded (b, T-1) layout, so the losses see exactly the tensors of the padded path. The same
attention serves verl's packed micro-batches without flash-attn (`verl_backend/patches.py`), which mark the
trajectories only by restarting `position_ids`.
"""

from __future__ import annotations

import functools
import itertools
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from SPA_agent.runs.bin_packing import first_fit_decreasing

#: name of the attention function in transformers' AttentionInterface
PACKED_ATTENTION = "spa_packed_sdpa"
#: keyword argument the packed forward passes down to the attention layers: trajectory lengths, a tuple of ints
SEGMENTS_KWARG = "spa_segments"


# ------------------------------------------------------------------------------------------------ plans


def plan_by_count(rows: int, size: int) -> list[list[int]]:
    """Consecutive groups of `size` row indices (the original micro-batching)."""
    return [list(range(start, min(start + size, rows))) for start in range(0, rows, size)]


def plan_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of row indices with at most `budget` real tokens each (first-fit decreasing, each bin in ascending
    row order); a row longer than the budget gets a bin of its own."""
    if budget < 1:
        raise ValueError(f"max_token_len_per_gpu must be >= 1, got {budget}")
    bins = first_fit_decreasing([min(int(n), budget) for n in lengths], budget)
    return [sorted(b) for b in bins]


def micro_batch_plan(attention_mask: torch.Tensor, micro_size: int, dynamic: bool, budget: int) -> list[list[int]]:
    """Row indices of each micro-batch of a (b, T) batch: by token budget when `dynamic`, else by count."""
    if dynamic:
        return plan_by_tokens(attention_mask.sum(dim=-1).tolist(), budget)
    return plan_by_count(attention_mask.shape[0], micro_size)


# ------------------------------------------------------------------------------------------------ packed rows


@dataclass
class PackedRows:
    """The real tokens of a (b, T) micro-batch as one row of L tokens, and the way back.

    rows, cols: (L,) where packed token p sits in the padded batch; segments: tokens per trajectory (> 0).
    """

    input_ids: torch.Tensor  # (1, L)
    position_ids: torch.Tensor  # (1, L)
    rows: torch.Tensor
    cols: torch.Tensor
    segments: tuple[int, ...]
    shape: tuple[int, int]  # (b, T) of the padded micro-batch

    @classmethod
    def pack(cls, micro: dict) -> PackedRows:
        real = micro["attention_mask"].bool()
        rows, cols = real.nonzero(as_tuple=True)  # row-major: each trajectory's tokens contiguous, in order
        segments = tuple(n for n in real.sum(dim=-1).tolist() if n > 0)
        return cls(micro["input_ids"][rows, cols][None], micro["position_ids"][rows, cols][None], rows, cols,
                   segments, tuple(real.shape))

    def next_token_positions(self) -> torch.Tensor:
        """(L,) bool: packed positions whose next packed token belongs to the same trajectory."""
        same = torch.zeros_like(self.rows, dtype=torch.bool)
        same[:-1] = self.rows[1:] == self.rows[:-1]
        return same

    def unpack(self, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """(b, T-1) tensor, zero except at column cols[p] of row rows[p] for the packed positions `keep`;
        `values` (L,) (differentiable)."""
        out = values.new_zeros((self.shape[0], self.shape[1] - 1))
        return out.index_put((self.rows[keep], self.cols[keep]), values[keep])


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: per-trajectory causal SDPA on packed rows, plain SDPA otherwise.

    A packed row is marked by `spa_segments` (the local backend's packed forward) or, without a mask, by
    `position_ids` that restart (verl's remove-padding forward, see `packed_segments`). Query (1, H, L, D) and
    key/value (1, H_kv, L, D) are then split into the trajectories' spans, each attending causally to itself
    only: one variable-length flash-attention call where it applies (`varlen_flash_applies`), else one SDPA call
    per span. Otherwise (padded batches, generation) this is transformers' SDPA attention with the mask it was
    given. Returns (1, L, H, D) and no weights.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = kwargs.pop(SEGMENTS_KWARG, None)
    if segments is None and attention_mask is None:
        segments = packed_segments(kwargs.get("position_ids"), query.shape[2], key.shape[2])
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout == 0.0:
        # under autocast the rotary step leaves query and key in float32 (its cos/sin are); SDPA would cast them to
        # the autocast dtype itself, so the flash kernel gets what SDPA would compute with
        compute = [x.to(_autocast_dtype(x)) for x in (query, key, value)]
        if varlen_flash_applies(compute[0], compute[1]):
            return varlen_flash_attention(*compute, segments, scaling), None
    return _sdpa_loop(query, key, value, segments, scaling, dropout), None


def _autocast_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype an autocast-listed op (SDPA) computes `tensor` in: the autocast dtype of its device where autocast
    is on there and `tensor` is float32, else its own."""
    if tensor.dtype == torch.float32 and torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype


def varlen_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Sequence[int],
                           scaling: float | None = None) -> torch.Tensor:
    """Causal attention of each trajectory of a packed row over its own tokens, in one call of flash attention's
    variable-length kernel (PyTorch's own, differentiable; grouped key/value heads read as they are).
    Query (1, H, L, D), key/value (1, H_kv, L, D), `segments` the trajectories' token counts; returns (1, L, H, D)."""
    offsets, longest = _offsets(tuple(segments), query.device)
    output = torch.ops.aten._flash_attention_forward(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), offsets, offsets, longest,
        longest, 0.0, True, False, scale=scaling,
    )[0]
    return output[None]


@functools.lru_cache(maxsize=4)
def _offsets(segments: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int]:
    """(cumulative token offsets (n+1,) int32 on `device`, the longest segment): every layer of a forward asks for
    the same row's, so they go to the device once per forward."""
    offsets = torch.tensor([0, *itertools.accumulate(segments)], dtype=torch.int32, device=device)
    return offsets, max(segments)


def varlen_flash_applies(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `varlen_flash_attention` serves these shapes here: a CUDA tensor in bf16/fp16, a head size flash
    attention takes, grouped heads; and a first call of the kernel on this device, dtype and head layout agreed
    with the per-trajectory SDPA loop, forward and backward (`_varlen_flash_agrees`)."""
    heads, head_dim, kv_heads = query.shape[1], query.shape[-1], key.shape[1]
    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        return False
    if head_dim % 8 or head_dim > 256 or heads % kv_heads:
        return False
    return _varlen_flash_agrees(query.device, query.dtype, heads, kv_heads, head_dim)


@functools.cache
def _varlen_flash_agrees(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """One check per process and layout: random inputs of three trajectories through both paths; outputs and
    input gradients must agree to the dtype's rounding. A kernel that fails or disagrees (a build without flash
    attention, an unsupported GPU) leaves the SDPA loop in use, with one warning.

    The check runs in a thread of its own: the first packed forward may run under no_grad, autocast or activation
    checkpointing (whose saved-tensor hooks would take over the check's backward pass), all of which are state of
    the calling thread."""
    outcome: list[str | None] = []
    worker = threading.Thread(target=lambda: outcome.append(_varlen_flash_mismatch(device, dtype, heads, kv_heads,
                                                                                   head_dim)))
    worker.start()
    worker.join()
    reason = outcome[0] if outcome else "the check did not finish"
    if reason is not None:
        warnings.warn(f"packed attention: flash attention's variable-length kernel is not used on {device} "
                      f"({dtype}, {heads}/{kv_heads} heads of {head_dim}): {reason}; one SDPA call per trajectory "
                      "instead", stacklevel=2)
    return reason is None


def _varlen_flash_mismatch(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                           head_dim: int) -> str | None:
    """Why `varlen_flash_attention` cannot stand in for the SDPA loop here, or None where it can."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    segments = (5, 17, 42)
    length = sum(segments)
    try:
        inputs = [torch.randn(1, n, length, head_dim, generator=generator, device=device, dtype=dtype)
                  for n in (heads, kv_heads, kv_heads)]
        grad_output = torch.randn(1, length, heads, head_dim, generator=generator, device=device, dtype=dtype)
        results = []
        for attend in (varlen_flash_attention, _sdpa_loop):
            leaves = [x.detach().requires_grad_() for x in inputs]
            output = attend(*leaves, segments, head_dim ** -0.5)
            output.backward(grad_output)
            results.append([output, *(leaf.grad for leaf in leaves)])
    except (RuntimeError, NotImplementedError) as error:  # no flash-attention kernel for this device or layout
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    for got, want in zip(*results, strict=True):
        if got is None or not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
            return "its outputs or gradients differ from the per-trajectory SDPA loop"
    return None


def _sdpa_loop(query, key, value, segments, scaling=None, dropout=0.0):
    """One causal SDPA call per trajectory of the packed row (grouped heads as transformers' SDPA attention passes
    them); (1, L, H, D)."""
    from torch.nn.functional import scaled_dot_product_attention

    outputs, start = [], 0
    for length in segments:
        span = slice(start, start + length)
        outputs.append(scaled_dot_product_attention(
            query[:, :, span], key[:, :, span], value[:, :, span], dropout_p=dropout, is_causal=True, scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1]).transpose(1, 2))
        start += length
    return torch.cat(outputs, dim=1)


#: (position_ids, its segments) of the last packed row seen: every layer of a forward gets the same tensor, so the
#: lengths are read to the host once per forward, not once per layer
_last_segments: tuple[torch.Tensor | None, tuple[int, ...] | None] = (None, None)


def packed_segments(position_ids: torch.Tensor | None, q_length: int, kv_length: int) -> tuple[int, ...] | None:
    """Token counts of the sequences packed into one row, from its `position_ids` (1, L): a sequence starts
    wherever the position does not follow the previous one by 1 (transformers' `find_packed_sequence_indices`).
    None for anything but a single row of L queries over its own L keys, or a row holding one sequence."""
    from transformers.masking_utils import find_packed_sequence_indices

    global _last_segments
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    if not q_length == kv_length == position_ids.shape[1]:
        return None
    if _last_segments[0] is not position_ids:
        sequence_of_token = find_packed_sequence_indices(position_ids)  # None: one sequence
        lengths = None if sequence_of_token is None else tuple(torch.bincount(sequence_of_token[0]).tolist())
        _last_segments = (position_ids, lengths)
    return _last_segments[1]


def packed_sdpa_mask(*args, attention_mask=None, **kwargs):
    """transformers mask builder: SDPA's, except for queries over their own keys without an `attention_mask`
    (packed rows, whose attention splits them by trajectory; or unpadded rows, which SDPA runs causally without a
    mask): then no mask, so no (L, L) block-diagonal mask is built for a packed row."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and kwargs.get("q_length") == kwargs.get("kv_length"):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def avoid_cudnn_attention() -> None:
    """Take cuDNN out of SDPA's backends (flash and memory-efficient attention remain). cuDNN builds an execution
    plan for every new sequence length, about 0.15 s per shape forward and backward on an H200; a rollout's
    trajectories all differ in length, which made each PPO step of the small model pay ~10 s of plan building
    (benchmarks/RESULTS.md). Flash attention has no per-shape cost."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def register_packed_attention() -> None:
    """Make `PACKED_ATTENTION` an attention implementation of transformers in this process (with
    `packed_sdpa_mask`, so padded batches keep their masks); models name it in `attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if PACKED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, packed_sdpa_mask)


def enable_packed_attention(model: nn.Module) -> None:
    """Route `model`'s attention through `packed_sdpa_attention`. The setting is not saved with the checkpoint."""
    register_packed_attention()
    model.config._attn_implementation = PACKED_ATTENTION

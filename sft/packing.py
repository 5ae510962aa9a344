"""Micro-batch plans, collation and the token-summed loss.

An optimizer step sees a *global batch* of samples (the same list on every rank). `plan_packed` packs it into
micro-batches of at most `token_budget` tokens each (first-fit decreasing); `plan_padded` cuts it into
micro-batches of `micro_batch_size` samples (the original recipe). Both give every rank the same number of
micro-batches (FSDP runs one all-gather per forward on every rank), filling gaps with empty ones.

Packed micro-batches are one row of concatenated samples, no padding, with `position_ids` restarting at 0 for
each sample and no `attention_mask`: transformers then builds a block-diagonal causal mask for sdpa, eager and
flex attention, so packed samples never attend to each other. Labels never cross a sample boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sft.spa_sft_dataset import SftSample
from SPA_agent.runs.bin_packing import first_fit_decreasing

IGNORE_INDEX = -100
Plan = list[list[list[int]]]  # [rank][micro-batch] -> sample indices


def _balance(chunks: list[list[int]], lengths: Sequence[int], world_size: int) -> Plan:
    """Deal chunks to ranks, heaviest first to the lightest rank with room; equal counts, empties padded."""
    per_rank = max(1, math.ceil(len(chunks) / world_size))
    plan: Plan = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for chunk in sorted(chunks, key=lambda c: -sum(lengths[i] for i in c)):
        rank = min((r for r in range(world_size) if len(plan[r]) < per_rank), key=lambda r: (loads[r], r))
        plan[rank].append(chunk)
        loads[rank] += sum(lengths[i] for i in chunk)
    for micro_batches in plan:
        micro_batches.extend([] for _ in range(per_rank - len(micro_batches)))
    return plan


def plan_packed(indices: Sequence[int], lengths: Sequence[int], world_size: int, token_budget: int) -> Plan:
    """Packed plan for the samples `indices` (lengths indexed by sample index)."""
    local = [lengths[i] for i in indices]
    longest = max(local, default=0)
    if longest > token_budget:
        raise ValueError(f"a sample of {longest} tokens exceeds data.max_tokens_per_micro_batch="
                         f"{token_budget}: set it to at least data.max_length")
    bins = [[indices[j] for j in b] for b in first_fit_decreasing(local, token_budget)]
    return _balance(bins, lengths, world_size)


def plan_padded(indices: Sequence[int], lengths: Sequence[int], world_size: int, micro_batch_size: int) -> Plan:
    """Original-recipe plan: consecutive groups of `micro_batch_size` samples."""
    chunks = [list(indices[i:i + micro_batch_size]) for i in range(0, len(indices), micro_batch_size)]
    return _balance(chunks, lengths, world_size)


def shifted_labels(sample: SftSample) -> torch.Tensor:
    """(T,) labels: position i is scored against input_ids[i+1] when that token is trained, else IGNORE_INDEX."""
    labels = torch.full_like(sample.input_ids, IGNORE_INDEX)
    labels[:-1] = torch.where(sample.loss_mask[1:].bool(), sample.input_ids[1:], IGNORE_INDEX)
    return labels


def collate_packed(samples: Sequence[SftSample], pad_id: int,
                   pad_to_multiple: int = 0) -> dict[str, torch.Tensor]:
    """One packed row. input_ids, position_ids, labels: (1, L), L = total tokens, rounded up as below.

    `pad_to_multiple` > 0 appends an untrained filler segment (its own positions, so nothing attends across
    it) up to the next multiple: few distinct shapes for compiled attention kernels. An empty micro-batch (a rank
    with fewer bins than another, `_balance`) is one untrained filler segment of `pad_to_multiple` tokens, or of
    1 token without padding: every rank still runs its forward, with no loss tokens.
    """
    total = sum(len(s) for s in samples)
    width = -(-total // pad_to_multiple) * pad_to_multiple if pad_to_multiple > 0 else total
    filler = max(width, pad_to_multiple, 1) - total
    if filler > 0:
        pad = torch.full((filler,), pad_id)
        samples = [*samples, SftSample(pad, torch.zeros_like(pad))]
    return {
        "input_ids": torch.cat([s.input_ids for s in samples])[None],
        "position_ids": torch.cat([torch.arange(len(s)) for s in samples])[None],
        "labels": torch.cat([shifted_labels(s) for s in samples])[None],
    }


def collate_padded(samples: Sequence[SftSample], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded rows. input_ids, attention_mask, position_ids, labels: (B, T), T = pad_to or the longest."""
    if not samples:
        return collate_packed([], pad_id)
    width = pad_to or max(len(s) for s in samples)
    batch = {"input_ids": torch.full((len(samples), width), pad_id),
             "attention_mask": torch.zeros(len(samples), width, dtype=torch.long),
             "position_ids": torch.arange(width).repeat(len(samples), 1),
             "labels": torch.full((len(samples), width), IGNORE_INDEX)}
    for row, sample in enumerate(samples):
        batch["input_ids"][row, :len(sample)] = sample.input_ids
        batch["attention_mask"][row, :len(sample)] = 1
        batch["labels"][row, :len(sample)] = shifted_labels(sample)
    return batch


def count_loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Number of labelled positions (trained tokens) in a collated micro-batch."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """(K,) positions that some row of `labels` (B, T) labels; position 0 alone when none does."""
    keep = (labels != IGNORE_INDEX).any(dim=0).nonzero().squeeze(-1)
    return keep if keep.numel() else torch.zeros(1, dtype=torch.long, device=labels.device)


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed cross-entropy (a scalar) over the labelled positions of one micro-batch.

    Logits are computed only at positions some row labels (`logits_to_keep`), so prompt positions cost no
    vocabulary projection. batch: input_ids, position_ids, labels (B, T) and optionally attention_mask (B, T).
    """
    labels = batch["labels"]
    keep = labelled_positions(labels)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits  # (B, K, V)
    targets = labels[:, keep]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")

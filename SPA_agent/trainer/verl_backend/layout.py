"""Our rollout layout ↔ the layout verl's workers read (pure tensor functions, no Ray, no GPU).

Ours (docs/interfaces.md, "One rollout"): each row is the whole conversation, LEFT padded to T; every per-token
tensor is (B, T-1) and column j is about token j+1 (`responses = input_ids[:, 1:]`, RAGEN's multi-turn layout).

verl's workers (`verl.workers.utils.padding`) expect `prompts` (B, P) left padded followed by `responses` (B, R)
RIGHT padded; `left_right_2_no_padding` packs the rows into nested (jagged) tensors and `no_padding_2_padding`
slices a per-token model output back to (B, R), where column j is about response token j.

The mapping used here: roll every row left by its padding count p_i, so the conversation starts at column 0;
then `prompts = input_ids[:, :1]` (the first token, never padding) and `responses = input_ids[:, 1:]`. Rolling a
(B, T-1) tensor of ours by the same p_i lands column j (token j+1) on column j - p_i (response token j - p_i,
which is the same token), and our left-padding columns land in verl's right padding. Outputs are rolled back
by +p_i. Column p_i - 1 of ours (token 0 predicted from padding) is never trained (masks are 0 there) and
comes back as 0.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

#: (B, T) tensors of our batch that verl's forward passes read
SEQUENCE_KEYS = ("input_ids", "attention_mask")


def padding_counts(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) number of left-padding columns of each row of a (B, T) attention mask."""
    return attention_mask.shape[1] - attention_mask.sum(dim=-1).long()


def roll_rows(x: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Roll row i of a (B, W) tensor by shifts[i] columns (like torch.roll on each row): out[i, j] = x[i, j - s_i]."""
    width = x.shape[1]
    columns = (torch.arange(width)[None, :] - shifts[:, None]) % width
    return x.gather(1, columns.to(x.device))


def to_verl_layout(batch: DataProto, token_keys: tuple[str, ...]) -> DataProto:
    """The batch in verl's prompt/response layout: right padded, `prompts` (B, 1), `responses` (B, T-1).

    Args:
        batch: our rollout batch; `attention_mask` (B, T) left padded.
        token_keys: (B, T-1) tensors to carry over (e.g. response_mask, old_log_probs, advantages).
    Returns:
        a DataProto with input_ids, attention_mask, position_ids (B, T), prompts (B, 1), responses (B, T-1),
        the token_keys rolled alongside, and the batch's meta_info; no non-tensor fields.
    """
    shifts = -padding_counts(batch.batch["attention_mask"])
    tensors = {key: roll_rows(batch.batch[key], shifts) for key in (*SEQUENCE_KEYS, *token_keys)}
    tensors["position_ids"] = (tensors["attention_mask"].cumsum(dim=-1) - 1).clamp(min=0)
    tensors["prompts"] = tensors["input_ids"][:, :1]
    tensors["responses"] = tensors["input_ids"][:, 1:]
    return DataProto.from_dict(tensors=tensors, meta_info=dict(batch.meta_info))


def balanced_order(attention_mask: torch.Tensor, dp_size: int) -> torch.Tensor:
    """A row order under which verl's dispatch, which hands each of `dp_size` data-parallel ranks one contiguous
    equal chunk of the rows, gives every rank about the same work: verl's `RayPPOTrainer._balance_batch`
    (Karmarkar–Karp partitions of equal size over `calculate_workload` of the row lengths, each partition's
    lighter rows at both of its ends).

    Args:
        attention_mask: (B, T) of the batch; B a multiple of dp_size.
        dp_size: data-parallel ranks.
    Returns:
        (B,) row indices: `batch[order]` is the dispatch order; `order.argsort()` restores the batch's.
    """
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    workload = calculate_workload(attention_mask.sum(dim=-1)).tolist()
    parts = get_seqlen_balanced_partitions(workload, k_partitions=dp_size, equal_size=True)
    order = []
    for part in parts:
        part = sorted(part, key=lambda row: (workload[row], row))
        order += part[::2] + part[1::2][::-1]
    return torch.tensor(order)


def worker_input(batch: DataProto, token_keys: tuple[str, ...], **meta) -> TensorDict:
    """What verl's engine workers take: the verl layout, unpadded to nested tensors, with `meta` attached.

    `response_mask` must be among `token_keys`: verl uses it as the loss mask (`loss_mask := response_mask`).
    """
    if "response_mask" not in token_keys:
        raise ValueError("verl's workers need response_mask in the batch")
    data = left_right_2_no_padding(to_verl_layout(batch, token_keys).to_tensordict())
    tu.assign_non_tensor(data, **meta)
    return data


def worker_output(tensor: torch.Tensor, data: TensorDict, attention_mask: torch.Tensor) -> torch.Tensor:
    """A per-token worker output (nested, one entry per real token) as a (B, T-1) tensor in our layout.

    Args:
        tensor: nested log-probs / entropies / values returned by a worker for `data`.
        data: the TensorDict from `worker_input` that produced it.
        attention_mask: (B, T) our left-padded attention mask.
    """
    padded = no_padding_2_padding(tensor, data)
    return roll_rows(padded, padding_counts(attention_mask).to(padded.device))

"""Split-KV decode attention that reads a prefix shared by a group of rows once (`generator.decode_attention=
split_kv_shared`, issue 42).

Why: in a PPO batch the rows come in groups (SPA: 32 puzzles × 8 samples), and the rows of a group share their first
prompt (on SmolLM2 ~556 tokens: system prompt, instructions, the initial state). The split-KV kernel
(split_kv_decode.py), bound by reading keys and values, read that prefix once per row at every decode step: 8 times
a group. Here it is read once per group and key/value head.

Tables (device tensors of fixed shape per decode state, filled in place before a call's decode, so a captured CUDA
graph reads the current ones):
- `shared_lengths` (B,) int32: row b's first `shared_lengths[b]` keys are those of its group's leader (0: not shared);
- `groups` (N, MEMBERS) int32: each group's rows, its leader first, -1 past its last member (a row in one group at
  most). Every row with a shared length is in a group.
Row b's prefix is `min(shared_lengths[b], kv_lengths[b] - 1)`: a finished row (`kv_lengths` 1) reads its one key
itself, and a running row always reads its newest keys itself (the shared prefix lies in the prompt).

Three kernels (split_kv_kernels.py):
1. `group_partials`: one program per (group, key/value head, split of SPLIT prefix keys). Its query block holds the
   G query heads of every member (MEMBERS × G rows, padded to a power of two of at least MIN_GROUP_ROWS: 32 rows for
   SmolLM2's 8 × 3), so each prefix key and value is read once, from the leader's row; member m's rows see the keys
   below its own prefix only. It writes each member's partial for that split.
2. `row_partials`: split_kv_decode's programs over each row's keys [prefix, kv_length).
3. `combine`: one program per (row, key/value head) merges the row's prefix and own partials by their
   log-sum-exps.
With the grid's splits capped (`max_splits`, split_kv_decode.py) a program of 1. or 2. reads every S-th chunk of SPLIT
keys from its own on and writes one partial of them.

Exactness: the shared keys are the model's keys of the same ids at the same positions, but a member's own keys may
have been computed by another forward (another prefill chunk, a suffix prefill of the reused prefix cache, an earlier
turn's prefill or decode step) and differ from the leader's in the last bits in bf16 on a GPU; reading the leader's is then a difference of the
size of the kernels' own rounding (the tests' tolerances are those of split_kv's). Identical prompts are prefilled
once and their keys copied (StaticDecoder._prefill_once), so in turn 1 the keys are the same bits.
"""

from __future__ import annotations

import math

import torch

from SPA_agent.generators.split_kv_decode import MIN_GROUP_ROWS, check_inputs, grid_splits, launch_options

#: most rows a group holds (rows that share a prefix with more are cut into several groups)
MEMBERS = 8
#: keys a row must share with its group's leader to join the group: shorter prefixes are read by the row itself
MIN_SHARED_KEYS = 64


def shared_prefixes(prompts: list[list[int]], min_keys: int = MIN_SHARED_KEYS, members: int = MEMBERS
                    ) -> tuple[list[int], list[list[int]]]:
    """Groups of rows whose prompts start with the same ids: per row the ids it shares with its group's leader (0:
    none), and the groups (row indices, leader first; at least two rows, at most `members`).

    The rows are sorted by their ids, so rows with long common prefixes are neighbours, and cut into consecutive
    groups that maximise the keys not read again, sum over groups of (rows - 1) × their common prefix, counting
    only prefixes of at least `min_keys` ids (`_best_cuts`). Exact: ids are compared, not hashed. A few ms for a
    PPO turn's 256 prompts of ~1,000 ids (Python lists: converting them to arrays would cost more)."""
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    neighbours = [common_prefix(prompts[a], prompts[b]) for a, b in zip(order, order[1:])]
    shared, groups = [0] * len(prompts), []
    for start, end in _best_cuts(neighbours, min_keys, members):
        group = order[start:end]
        groups.append(group)
        common = neighbours[start]
        for member, pair in zip(group[1:], neighbours[start : end - 1]):
            common = min(common, pair)  # the member's prefix in common with the leader
            shared[member] = common
        shared[group[0]] = neighbours[start]  # the longest of its members'
    return shared, groups


def common_prefix(first: list[int], second: list[int], block: int = 64) -> int:
    """How many first ids two lists have in common (compared a block at a time, then id by id)."""
    length = min(len(first), len(second))
    start = 0
    while start < length and first[start : start + block] == second[start : start + block]:
        start += block
    end = min(start + block, length)
    return next((i for i in range(start, end) if first[i] != second[i]), end)


def _best_cuts(neighbours: list[int], min_keys: int, members: int) -> list[tuple[int, int]]:
    """Consecutive groups [start, end) of sorted rows (`neighbours[i]`: common prefix of rows i and i+1) of 2 to
    `members` rows whose common prefix is at least `min_keys`, maximising sum (rows - 1) × common prefix (dynamic
    programming over the first j rows)."""
    rows = len(neighbours) + 1
    best, cut = [0] * (rows + 1), [0] * (rows + 1)  # best saving of the first j rows, where its last group starts
    for end in range(1, rows + 1):
        best[end], cut[end] = best[end - 1], end - 1  # row end-1 alone
        common = 0x7FFFFFFF
        for start in range(end - 2, max(-1, end - members - 1), -1):
            common = min(common, neighbours[start])
            if common < min_keys:
                break
            if best[start] + (end - start - 1) * common > best[end]:
                best[end], cut[end] = best[start] + (end - start - 1) * common, start
    groups, end = [], rows
    while end > 0:
        if end - cut[end] > 1:
            groups.append((cut[end], end))
        end = cut[end]
    return groups[::-1]


class PrefixTables:
    """The shared-prefix tables of a decode state of `batch` rows (module docstring): device tensors of fixed shape,
    filled in place by `fill`, zero (nothing shared) until then."""

    def __init__(self, batch: int, device: torch.device):
        self.shared_lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.groups = torch.full((max(1, batch // 2), MEMBERS), -1, dtype=torch.int32, device=device)

    def fill(self, shared: list[int], groups: list[list[int]]) -> None:
        """Rows [0, len(shared)) share `shared` keys in `groups` (`shared_prefixes`); the rows past them nothing."""
        lengths = torch.zeros(self.shared_lengths.shape, dtype=torch.int32)
        lengths[: len(shared)] = torch.tensor(shared, dtype=torch.int32)
        table = torch.full(self.groups.shape, -1, dtype=torch.int32)
        for index, group in enumerate(groups):
            table[index, : len(group)] = torch.tensor(group, dtype=torch.int32)
        self.shared_lengths.copy_(lengths)
        self.groups.copy_(table)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(shared_lengths, groups), as `shared_prefix_decode` takes them."""
        return self.shared_lengths, self.groups


def _block_rows(rows: int) -> int:
    """Rows of a query block: a power of two, at least tl.dot's minimum."""
    return max(MIN_GROUP_ROWS, 1 << (rows - 1).bit_length())


def shared_prefix_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_lengths: torch.Tensor,
                         tables: tuple[torch.Tensor, torch.Tensor], scaling: float | None = None, *,
                         split: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, max_splits: int | None = None) -> torch.Tensor:
    """Decode attention: query (B, H, 1, D), cache key/value (B, L, H_kv, D), row b reading its first
    kv_lengths[b] ≥ 1 keys, of which the first min(shared_lengths[b], kv_lengths[b] - 1) from its group's leader's
    row; tables = (shared_lengths (B,) int32, groups (N, MEMBERS) int32), module docstring. (B, 1, H, D) in the
    query's dtype. Query head h reads key/value head h // (H / H_kv). The launch parameters are split_kv_decode's
    (None: split_kv_decode.py's constants), for all three kernels (`max_splits`: programs per (group or row, key/value
    head) for the prefix and for a row's own keys each)."""
    from SPA_agent.generators.split_kv_kernels import group_partials, row_partials, shared_combine

    shared_lengths, groups = tables
    check_inputs(query, key, value)
    split, block_n, max_splits, launch = launch_options(split, block_n, num_warps, num_stages, max_splits)
    batch, heads, _, head_dim = query.shape
    length, kv_heads = key.shape[1], key.shape[2]
    group, members = heads // kv_heads, groups.shape[1]
    num_splits = grid_splits(length, split, max_splits)
    num_slots = 2 * num_splits  # per row and key/value head: the prefix's splits, then its own keys' splits
    chunked = num_splits * split < length  # the grid capped: a program reads every num_splits-th chunk
    partial_out = torch.empty((batch, kv_heads, num_slots, group, head_dim), dtype=torch.float32, device=query.device)
    partial_lse = torch.empty((batch, kv_heads, num_slots, group), dtype=torch.float32, device=query.device)
    out = torch.empty((batch, 1, heads, head_dim), dtype=query.dtype, device=query.device)
    scale_log2 = (scaling if scaling is not None else 1.0 / math.sqrt(head_dim)) * math.log2(math.e)
    strides = (query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2))
    shapes = dict(KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, SPLIT=split, **launch)
    group_partials[(groups.shape[0], kv_heads, num_splits)](
        query, key, value, kv_lengths, shared_lengths, groups, partial_out, partial_lse, scale_log2, *strides,
        num_splits, num_slots, MEMBERS=members, QUERY_ROWS=_block_rows(members * group), BLOCK_N=block_n,
        CHUNKED=chunked, **shapes)
    row_partials[(batch, kv_heads, num_splits)](
        query, key, value, kv_lengths, shared_lengths, partial_out, partial_lse, scale_log2, *strides, num_splits,
        num_slots, GROUP_ROWS=_block_rows(group), BLOCK_N=block_n, CHUNKED=chunked, **shapes)
    shared_combine[(batch, kv_heads)](
        partial_out, partial_lse, kv_lengths, shared_lengths, out, num_splits, num_slots,
        GROUP_ROWS=_block_rows(group), **shapes)
    return out

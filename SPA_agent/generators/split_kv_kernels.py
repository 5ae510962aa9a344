"""The Triton kernels of the split-KV decode attention: `partials` and `combine` of split_kv_decode.py, and
`group_partials`, `row_partials` and `shared_combine` of shared_prefix_decode.py (their docstrings say what they
compute). Every partial kernel walks its keys with `_attend`. A module of its own, imported on first use, so that
importing the decoder needs no triton; Triton finds the helpers a kernel calls among a module's globals, which
functions defined inside a function are not."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend(q, K, V, base, stride_kl, first, length, step, limits, scale_log2, d,
            ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
            CHUNKED: tl.constexpr):
    """Query rows q (ROWS, D) against the keys of the cache row at `base` in the chunks of SPLIT keys that start at
    first, first + step, ... below `length` (CHUNKED: the grid's splits capped, split_kv_decode.py; else one chunk),
    query row r reading the keys below limits[r] (≤ length, > first, so each row reads at least one key); the
    normalised output (ROWS, D) and the log-sum-exp (base 2) of each row. split_kv_decode's arithmetic: float32
    scores and sums, probabilities rounded to the value dtype before their product with the values."""
    best = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    if CHUNKED:
        chunks = tl.cdiv(length - first, step)
        last = first + (chunks - 1) * step
        blocks = (chunks - 1) * (SPLIT // BLOCK_N) + tl.cdiv(tl.minimum(length - last, SPLIT), BLOCK_N)
    else:
        blocks = tl.cdiv(tl.minimum(length - first, SPLIT), BLOCK_N)
    for block in range(0, blocks):
        if CHUNKED:
            n = first + (block // (SPLIT // BLOCK_N)) * step + (block % (SPLIT // BLOCK_N)) * BLOCK_N
        else:
            n = first + block * BLOCK_N
        keys = n + tl.arange(0, BLOCK_N)
        valid = keys < length  # a chunk's blocks lie inside it (SPLIT a multiple of BLOCK_N)
        offsets = base + keys[:, None] * stride_kl + d[None, :]
        k = tl.load(K + offsets, mask=valid[:, None], other=0.0)
        v = tl.load(V + offsets, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        scores = tl.where(keys[None, :] < limits[:, None], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        p = tl.exp2(scores - new_best[:, None])
        rescale = tl.exp2(best - new_best)
        total = total * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        best = new_best
    return acc / total[:, None], best + tl.log2(total)


@triton.jit
def _row_partial(Q, K, V, partial_out, partial_lse, row, head, start, length, slot, scale_log2,
                 stride_qb, stride_qh, stride_kb, stride_kl, stride_kh, step,
                 GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, CHUNKED: tl.constexpr):
    """The G query heads of (row, key/value head) against the row's keys in its chunks from `start` below `length`
    (`_attend`), stored as partial `slot` (its output and log-sum-exp)."""
    g = tl.arange(0, GROUP_ROWS)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + row * stride_qb + (head * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0)
    out, lse = _attend(q, K, V, row * stride_kb + head * stride_kh, stride_kl, start, length, step,
                       tl.zeros([GROUP_ROWS], tl.int32) + length, scale_log2, d,
                       GROUP_ROWS, HEAD_DIM, SPLIT, BLOCK_N, CHUNKED)
    tl.store(partial_out + (slot * GROUP + g)[:, None] * HEAD_DIM + d[None, :], out, mask=(g < GROUP)[:, None])
    tl.store(partial_lse + slot * GROUP + g, lse, mask=g < GROUP)


@triton.jit
def partials(Q, K, V, lengths, partial_out, partial_lse, scale_log2,
             stride_qb, stride_qh, stride_kb, stride_kl, stride_kh, num_splits,
             KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr,
             HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_FIRST: tl.constexpr,
             CHUNKED: tl.constexpr):
    """split_kv_decode: one program per (row, key/value head, split): the G query heads of the key/value head against
    the program's chunks of the row's keys; the split's partial (B, H_kv, S) slots."""
    if HEADS_FIRST:  # consecutive programs read the key/value heads of one row (neighbouring bytes)
        head, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    else:
        row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)  # int64: large caches
    split = tl.program_id(2)
    length = tl.load(lengths + row)
    first = split * SPLIT
    if first < length:
        _row_partial(Q, K, V, partial_out, partial_lse, row, head, first, length,
                     (row * KV_HEADS + head) * num_splits + split,  # (B, H_kv, S) flattened
                     scale_log2, stride_qb, stride_qh, stride_kb, stride_kl, stride_kh, num_splits * SPLIT,
                     GROUP, GROUP_ROWS, HEAD_DIM, SPLIT, BLOCK_N, CHUNKED)


@triton.jit
def combine(partial_out, partial_lse, lengths, out, num_splits,
            KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr,
            HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr):
    """split_kv_decode: one program per (row, key/value head) merges the row's partials by their log-sum-exps (the
    largest first, then the weighted sum); out (B, 1, H, D)."""
    row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    used = tl.minimum(tl.cdiv(tl.load(lengths + row), SPLIT), num_splits)  # the programs that wrote a partial
    g = tl.arange(0, GROUP_ROWS)
    d = tl.arange(0, HEAD_DIM)
    first = (row * KV_HEADS + head) * num_splits
    best = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    for split in range(0, used):
        lse = tl.load(partial_lse + (first + split) * GROUP + g, mask=g < GROUP, other=0.0)
        best = tl.maximum(best, lse)
    total = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
    for split in range(0, used):
        lse = tl.load(partial_lse + (first + split) * GROUP + g, mask=g < GROUP, other=0.0)
        weight = tl.exp2(lse - best)
        part = tl.load(partial_out + ((first + split) * GROUP + g)[:, None] * HEAD_DIM + d[None, :],
                       mask=(g < GROUP)[:, None], other=0.0)
        acc += weight[:, None] * part
        total += weight
    heads = (row * KV_HEADS + head) * GROUP + g  # out (B, 1, H, D) contiguous: query head head·G + g of the row
    tl.store(out + heads[:, None] * HEAD_DIM + d[None, :], (acc / total[:, None]).to(out.dtype.element_ty),
             mask=(g < GROUP)[:, None])


@triton.jit
def group_partials(Q, K, V, kv_lengths, shared_lengths, groups, partial_out, partial_lse, scale_log2,
                   stride_qb, stride_qh, stride_kb, stride_kl, stride_kh, num_splits, num_slots,
                   KV_HEADS: tl.constexpr, GROUP: tl.constexpr, MEMBERS: tl.constexpr, QUERY_ROWS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKED: tl.constexpr):
    """One program per (group, key/value head, split of the prefix): the G query heads of every member in one query
    block, the prefix keys read once from the leader's row; each member's partial of the split (prefix slots)."""
    group, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tl.arange(0, QUERY_ROWS)  # query row r: query head head·G + r % G of member r // G
    member, g = r // GROUP, r % GROUP
    rows = tl.load(groups + group * MEMBERS + member, mask=member < MEMBERS, other=-1).to(tl.int64)
    present = rows >= 0
    limits = tl.minimum(tl.load(shared_lengths + rows, mask=present, other=0),
                        tl.load(kv_lengths + rows, mask=present, other=1) - 1)  # each member's prefix
    start = split * SPLIT
    length = tl.max(limits, 0)
    if start < length:
        used = limits > start  # members whose prefix reaches into this program's first chunk
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + rows[:, None] * stride_qb + (head * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=used[:, None], other=0.0)
        leader = tl.load(groups + group * MEMBERS).to(tl.int64)
        out, lse = _attend(q, K, V, leader * stride_kb + head * stride_kh, stride_kl, start, length,
                           num_splits * SPLIT, tl.where(used, limits, length), scale_log2, d,
                           QUERY_ROWS, HEAD_DIM, SPLIT, BLOCK_N, CHUNKED)
        slot = (rows * KV_HEADS + head) * num_slots + split  # (B, H_kv, slots) flattened; prefix slots first
        tl.store(partial_out + (slot * GROUP + g)[:, None] * HEAD_DIM + d[None, :], out, mask=used[:, None])
        tl.store(partial_lse + slot * GROUP + g, lse, mask=used)


@triton.jit
def row_partials(Q, K, V, kv_lengths, shared_lengths, partial_out, partial_lse, scale_log2,
                 stride_qb, stride_qh, stride_kb, stride_kl, stride_kh, num_splits, num_slots,
                 KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKED: tl.constexpr):
    """One program per (row, key/value head, split of the row's own keys [prefix, kv_length)): split_kv_decode's
    partials, in the slots after the prefix's."""
    row, head, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # int64: large caches
    length = tl.load(kv_lengths + row)
    start = tl.minimum(tl.load(shared_lengths + row), length - 1) + split * SPLIT
    if start < length:
        _row_partial(Q, K, V, partial_out, partial_lse, row, head, start, length,
                     (row * KV_HEADS + head) * num_slots + num_splits + split,
                     scale_log2, stride_qb, stride_qh, stride_kb, stride_kl, stride_kh, num_splits * SPLIT,
                     GROUP, GROUP_ROWS, HEAD_DIM, SPLIT, BLOCK_N, CHUNKED)


@triton.jit
def _merge(partial_out, partial_lse, first, count, best, total, acc, g, d,
           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The running (best, total, acc) with `count` partials from slot `first` on merged in by log-sum-exp."""
    for slot in range(first, first + count):
        lse = tl.load(partial_lse + slot * GROUP + g, mask=g < GROUP, other=0.0)
        part = tl.load(partial_out + (slot * GROUP + g)[:, None] * HEAD_DIM + d[None, :],
                       mask=(g < GROUP)[:, None], other=0.0)
        new_best = tl.maximum(best, lse)
        rescale, weight = tl.exp2(best - new_best), tl.exp2(lse - new_best)
        acc = acc * rescale[:, None] + weight[:, None] * part
        total = total * rescale + weight
        best = new_best
    return best, total, acc


@triton.jit
def shared_combine(partial_out, partial_lse, kv_lengths, shared_lengths, out, num_splits, num_slots,
            KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr,
            HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr):
    """One program per (row, key/value head): the row's prefix partials and its own merged; out (B, 1, H, D)."""
    row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    length = tl.load(kv_lengths + row)
    prefix = tl.minimum(tl.load(shared_lengths + row), length - 1)
    g = tl.arange(0, GROUP_ROWS)
    d = tl.arange(0, HEAD_DIM)
    first = (row * KV_HEADS + head) * num_slots
    best = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
    # the programs that wrote a partial: one a chunk of SPLIT keys, at most num_splits
    best, total, acc = _merge(partial_out, partial_lse, first, tl.minimum(tl.cdiv(prefix, SPLIT), num_splits),
                              best, total, acc, g, d, GROUP, HEAD_DIM)
    best, total, acc = _merge(partial_out, partial_lse, first + num_splits,
                              tl.minimum(tl.cdiv(length - prefix, SPLIT), num_splits), best, total, acc, g, d,
                              GROUP, HEAD_DIM)
    heads = (row * KV_HEADS + head) * GROUP + g  # out (B, 1, H, D) contiguous: query head head·G + g of the row
    tl.store(out + heads[:, None] * HEAD_DIM + d[None, :], (acc / total[:, None]).to(out.dtype.element_ty),
             mask=(g < GROUP)[:, None])

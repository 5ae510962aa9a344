"""Split-KV decode attention in Triton for the static decoder (`generator.decode_attention=split_kv`, issue 42).

A decode step has one query token per row. Flash attention's variable-length forward, the decoder's other GPU
path, tiles 128 query rows per thread block and walks a row's keys in one block: a decode step fills one to three of
those rows (the query heads that share a key/value head), and a row of 1,500 keys is walked by a single block, so
on SmolLM2 its kernel was 60% of a decode step at a fraction of the memory bandwidth (benchmarks/RESULTS.md, "The
decode step alone"). Here, as in flash-decoding:

1. `_partials`: one program per (row, key/value head, split of SPLIT keys). The G query heads that share the
   key/value head are G rows of one small matrix product, so each key and value is read once per row and head. A
   program whose split starts past the row's length does nothing, so a finished row (one key) costs one program.
   It writes the split's normalised output and its log-sum-exp (base 2).
2. `_combine`: one program per (row, key/value head) merges the row's used splits by their log-sum-exps.

The grid's splits come from the cache's allocated length L (ceil(L / SPLIT)), not from the longest row: a CUDA graph
fixes the grid at capture while the lengths change at every replay. With the decoder's kept KV buffer
(generator.keep_decode_graphs: at least twice the longest call's keys) most of a short turn's programs start past
their row's end and exit. `max_splits` caps the grid at that many programs per (row, head) whatever L: program s then
reads the row's SPLIT-key chunks s, s + S, s + 2S, ... (S the grid's splits) and writes one partial of them all
(default None: one chunk a program, as above). The launch parameters (split, block_n, num_warps, num_stages,
max_splits, heads_first) are arguments so that benchmarks/decode_attention_kernels.py can sweep them; the defaults
are the values the decoder runs.

The arithmetic is attention's (float32 scores and sums, probabilities rounded to the value dtype before their
product with the values, as flash attention does); only the order of the sums differs, so the sampling distribution
is unchanged. Needs triton (CUDA builds of torch bring it). On CPU the kernels run only under Triton's interpreter
(`TRITON_INTERPRET=1`), which the tests use to check them against the masked reference.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

from SPA_agent.generators.static_decode import ATTENTION_KERNELS

#: keys per split: a row of L keys is read by ceil(L / SPLIT) programs
SPLIT = 256
#: keys per inner block of a program
BLOCK_N = 64
#: warps per program of either kernel
NUM_WARPS = 4
#: software-pipelining stages of the kernels' key loops (None: Triton's default)
NUM_STAGES = None
#: most programs per (row, key/value head) (None: ceil(L / SPLIT), one split of SPLIT keys a program)
MAX_SPLITS = None
#: tl.dot needs at least 16 rows: the G query heads of a key/value head are padded to this
MIN_GROUP_ROWS = 16


#: generator.decode_attention: `auto` is split_kv on a CUDA GPU where triton is installed, flash elsewhere;
#: `auto_shared` is split_kv_shared there, flash elsewhere (SmolLM2's preset: its CPU runs keep working)
SETTINGS = ("auto", "auto_shared", *ATTENTION_KERNELS)


def available() -> bool:
    """Whether triton can be imported (CUDA builds of torch bring it)."""
    return importlib.util.find_spec("triton") is not None


def resolve(setting: str, device: torch.device) -> str:
    """The static decoder's attention kernel (one of ATTENTION_KERNELS) for generator.decode_attention on `device`;
    a one-line ValueError where a Triton kernel (split_kv, split_kv_shared) cannot run (no triton; CPU tensors
    outside Triton's interpreter)."""
    if setting not in SETTINGS:
        raise ValueError(f"generator.decode_attention must be one of {SETTINGS}, got {setting!r}")
    if setting in ("auto", "auto_shared"):
        return ("split_kv" if setting == "auto" else "split_kv_shared") if device.type == "cuda" and available() \
            else "flash"
    triton_runs = available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    if setting != "flash" and not triton_runs:
        raise ValueError(f"generator.decode_attention={setting} needs triton and a CUDA GPU; "
                         "set generator.decode_attention=flash")
    return setting


@functools.cache
def _kernels():
    """The two Triton kernels, defined on first use so that importing this module needs no triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def _partials(Q, K, V, lengths, partial_out, partial_lse, scale_log2,
                  stride_qb, stride_qh, stride_kb, stride_kl, stride_kh,
                  num_splits,
                  KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_FIRST: tl.constexpr,
                  CHUNKED: tl.constexpr):
        if HEADS_FIRST:  # consecutive programs read the key/value heads of one row (neighbouring bytes)
            head, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
        else:
            row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)  # int64: large caches
        split = tl.program_id(2)
        length = tl.load(lengths + row)
        first = split * SPLIT
        if first < length:
            # this program's chunks of SPLIT keys: first, first + step, ... below the row's length (CHUNKED: the grid
            # capped by max_splits; else one chunk), walked as one loop of BLOCK_N-key blocks
            step = num_splits * SPLIT
            if CHUNKED:
                chunks = tl.cdiv(length - first, step)
                last = first + (chunks - 1) * step
                blocks = (chunks - 1) * (SPLIT // BLOCK_N) + tl.cdiv(tl.minimum(length - last, SPLIT), BLOCK_N)
            else:
                blocks = tl.cdiv(tl.minimum(length - first, SPLIT), BLOCK_N)
            g = tl.arange(0, GROUP_ROWS)
            d = tl.arange(0, HEAD_DIM)
            q = tl.load(Q + row * stride_qb + (head * GROUP + g)[:, None] * stride_qh + d[None, :],
                        mask=(g < GROUP)[:, None], other=0.0)
            best = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
            total = tl.zeros([GROUP_ROWS], tl.float32)
            acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
            base = row * stride_kb + head * stride_kh
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
                scores = tl.where(valid[None, :], scores, float("-inf"))
                new_best = tl.maximum(best, tl.max(scores, 1))
                p = tl.exp2(scores - new_best[:, None])
                rescale = tl.exp2(best - new_best)
                total = total * rescale + tl.sum(p, 1)
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                best = new_best
            slot = (row * KV_HEADS + head) * num_splits + split  # (B, H_kv, S) flattened
            tl.store(partial_out + (slot * GROUP + g)[:, None] * HEAD_DIM + d[None, :], acc / total[:, None],
                     mask=(g < GROUP)[:, None])
            tl.store(partial_lse + slot * GROUP + g, best + tl.log2(total), mask=g < GROUP)

    @triton.jit
    def _combine(partial_out, partial_lse, lengths, out, num_splits,
                 KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr):
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
        # out (B, 1, H, D) contiguous: query head h = head·G + g of row `row`
        heads = (row * KV_HEADS + head) * GROUP + g
        tl.store(out + heads[:, None] * HEAD_DIM + d[None, :], (acc / total[:, None]).to(out.dtype.element_ty),
                 mask=(g < GROUP)[:, None])

    return _partials, _combine


def check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """One-line errors for inputs the kernels do not read: keys and values of two layouts, a head dimension not
    contiguous, a head size not a power of two of at least 16."""
    head_dim = query.shape[-1]
    if key.stride() != value.stride() or key.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("split_kv_decode needs keys and values of one layout, contiguous in the head dimension")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"split_kv_decode needs a power-of-two head size of at least 16, got {head_dim}")


def launch_options(split: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, max_splits: int | None = None) -> tuple[int, int, int | None, dict]:
    """The launch parameters, None standing for this module's constant (read at the call, so that a benchmark may
    set them): (split, block_n, max_splits, the launches' keyword arguments). One-line errors for values the kernels
    cannot run: keys a split a multiple of the keys a block, itself a power of two of at least 16 (tl.dot); warps a
    power of two."""
    split, block_n = SPLIT if split is None else split, BLOCK_N if block_n is None else block_n
    num_warps = NUM_WARPS if num_warps is None else num_warps
    num_stages = NUM_STAGES if num_stages is None else num_stages
    max_splits = MAX_SPLITS if max_splits is None else max_splits
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two of at least 16, got {block_n}")
    if split < block_n or split % block_n:
        raise ValueError(f"split must be a positive multiple of block_n={block_n}, got {split}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    if max_splits is not None and max_splits < 1:
        raise ValueError(f"max_splits must be at least 1 (or None), got {max_splits}")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"num_stages must be at least 1 (or None), got {num_stages}")
    return split, block_n, max_splits, {"num_warps": num_warps} | ({} if num_stages is None else
                                                                   {"num_stages": num_stages})


def grid_splits(length: int, split: int, max_splits: int | None) -> int:
    """Programs per (row, key/value head) for a cache of `length` keys a row: one per `split` keys, at most
    `max_splits`. From shapes and arguments only, never from the rows' lengths (CUDA graphs fix the grid)."""
    splits = -(-length // split)
    return splits if max_splits is None else min(splits, max_splits)


def split_kv_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_lengths: torch.Tensor,
                    scaling: float | None = None, *, split: int | None = None, block_n: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None, max_splits: int | None = None,
                    heads_first: bool = False) -> torch.Tensor:
    """Decode attention: query (B, H, 1, D), cache key/value (B, L, H_kv, D), row b reading its first
    kv_lengths[b] ≥ 1 keys; (B, 1, H, D) in the query's dtype. Query head h reads key/value head h // (H / H_kv),
    as in transformers' `repeat_kv`.

    Launch parameters, None for the module's constants (SPLIT, BLOCK_N, NUM_WARPS, NUM_STAGES, MAX_SPLITS: what the
    decoder runs; benchmarks/decode_attention_kernels.py sweeps them): `split` keys a program's chunk, `block_n` keys
    an inner block, `num_warps` and `num_stages` (None: Triton's default) of both kernels, `max_splits` most programs
    per (row, key/value head) (module docstring), `heads_first` the grid's first dimension the key/value heads rather
    than the rows. The sums' order follows `split` and `block_n`."""
    partials, combine = _kernels()
    check_inputs(query, key, value)
    split, block_n, max_splits, launch = launch_options(split, block_n, num_warps, num_stages, max_splits)
    batch, heads, _, head_dim = query.shape
    length, kv_heads = key.shape[1], key.shape[2]
    group = heads // kv_heads
    group_rows = max(MIN_GROUP_ROWS, 1 << (group - 1).bit_length())
    num_splits = grid_splits(length, split, max_splits)
    partial_out = torch.empty((batch, kv_heads, num_splits, group, head_dim), dtype=torch.float32,
                              device=query.device)
    partial_lse = torch.empty((batch, kv_heads, num_splits, group), dtype=torch.float32, device=query.device)
    out = torch.empty((batch, 1, heads, head_dim), dtype=query.dtype, device=query.device)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    grid = (kv_heads, batch, num_splits) if heads_first else (batch, kv_heads, num_splits)
    partials[grid](
        query, key, value, kv_lengths, partial_out, partial_lse, scale * math.log2(math.e),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2), num_splits,
        KV_HEADS=kv_heads, GROUP=group, GROUP_ROWS=group_rows, HEAD_DIM=head_dim, SPLIT=split, BLOCK_N=block_n,
        HEADS_FIRST=heads_first, CHUNKED=num_splits * split < length, **launch,
    )
    combine[(batch, kv_heads)](
        partial_out, partial_lse, kv_lengths, out, num_splits,
        KV_HEADS=kv_heads, GROUP=group, GROUP_ROWS=group_rows, HEAD_DIM=head_dim, SPLIT=split, **launch,
    )
    return out

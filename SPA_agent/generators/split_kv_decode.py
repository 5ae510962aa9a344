"""Split-KV decode attention in Triton for the static decoder (`generator.decode_attention=split_kv`, issue 42).

A decode step has one query token per row. Flash attention's variable-length forward, the decoder's other GPU
path, tiles 128 query rows per thread block and walks a row's keys in one block: a decode step fills one to three of
those rows (the query heads that share a key/value head), and a row of 1,500 keys is walked by a single block, so
on SmolLM2 its kernel was 60% of a decode step at a fraction of the memory bandwidth (benchmarks/RESULTS.md, "The
decode step alone"). Here, as in flash-decoding:

1. `partials`: one program per (row, key/value head, split of SPLIT keys). The G query heads that share the
   key/value head are G rows of one small matrix product, so each key and value is read once per row and head. A
   program whose split starts past the row's length does nothing, so a finished row (one key) costs one program.
   It writes the split's normalised output and its log-sum-exp (base 2).
2. `combine`: one program per (row, key/value head) merges the row's used splits by their log-sum-exps.

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


def _kernels():
    """The two Triton kernels (split_kv_kernels.py), imported on first use so that importing this module needs no
    triton."""
    from SPA_agent.generators.split_kv_kernels import combine, partials

    return partials, combine


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

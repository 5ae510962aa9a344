"""A compact decode loop over a transformers causal LM's own forward: static KV cache, CUDA graphs (issues 9, 17).

Why not `model.generate`: with left padding, transformers' SDPA attention receives a mask and then copies
every key/value head `num_attention_heads / num_key_value_heads` times per layer and step (`repeat_kv`), which
dominates decoding time for GQA models at large batch. Here:

- the cache holds keys/values as (B, L, H_kv, D) per layer (flash attention's layout), L = longest prompt +
  max_new_tokens; row b keeps its prompt at positions [0, n_b) and its t-th new token at n_b + t, so the keys a
  row attends to are always a prefix of its row, of length `kv_lengths[b]`;
- prefill runs the prompts right-padded (row chunks of at most `prefill_chunk_tokens` tokens, default
  PREFILL_TOKENS, longest prompts first, each chunk as wide as its longest prompt) causally, without a mask, so
  SDPA takes its flash kernel; the first new token's logits come from each row's last prompt position;
- each decode step feeds one token per sequence. On an Ampere or newer GPU with bf16/fp16 weights, attention is
  flash attention's variable-length kernel reading each row's first `kv_lengths[b]` keys (`seqused_k`); the G
  query heads that share a key/value head run as G query positions of that head, so each key/value is read once
  per row and head (not G times), keys and values are never copied, and padding and the unwritten tail are never
  read. With `attention="split_kv"` (generator.decode_attention, the GPU default where triton is installed) our
  Triton split-KV kernel does the same attention with each row's keys spread over thread blocks
  (split_kv_decode.py); with `attention="split_kv_shared"` (SmolLM2's on a GPU: decode_attention=auto_shared) the
  rows whose prompts start with the same ids (a PPO batch's samples of one puzzle) read that common prefix once per
  group of rows, and identical prompts are prefilled once, their keys copied (`_prefill_once`;
  shared_prefix_decode.py). Elsewhere the same prefix is masked in one SDPA call whose query rows are the G = H / H_kv
  query heads sharing a key/value head;
- a row that has finished (emitted an end of turn) keeps its place in the batch but attends to its first key only:
  a turn decodes until its longest sample ends (on SmolLM2 about 255 steps while the mean sample is ~100 tokens),
  and decode attention reads each row's whole history, so most of its reads were for rows already finished.
  Rows are independent, so the running rows' logits, and every sample, are unchanged (tested);
- on GPU the decode step (forward + cache bookkeeping) is captured once per (B, L) in a CUDA graph and replayed,
  which removes the per-kernel launch overhead of a 24–28-layer model;
- optionally (`keep_graphs`, generator.keep_decode_graphs) the buffers and graphs outlive a call. A rollout's
  calls (one a turn) differ in B and L, so each captured a new graph (0.8–1.3 s of a PPO step's ~6.7 s of
  generation on SmolLM2, H200). Kept, all calls share one KV buffer of `rows` × `max_len` keys, grown when a call
  needs more: rows to its batch rounded up to BATCH_BUCKET, keys at least CAPACITY_GROWTH-fold (a new buffer drops
  every state, whose graphs read the old one), so a run regrows it a few times, and the buffer holds at most
  CAPACITY_GROWTH times the longest call's keys. A decode state (and graph) is kept per batch size rounded up to
  BATCH_BUCKET and uses the buffer's first rows; its row stride is the buffer's `max_len`, so cu_seqlens_k = b·L
  stays right. The extra rows are padding: finished from the start (they read one key, as finished rows do), never
  prefilled, and the sampler sees the real rows' logits only, so every random draw, and every sample, is what the
  decoder without kept graphs draws (tested). Weights updated in place (an optimizer step, `copy_`) are what the
  kept graphs read; weights moved to new tensors drop the states (their addresses are compared every call).
  Off by default: not yet measured on a GPU, and the buffer and graphs stay allocated while a PPO actor trains
  on the same GPU;
- optionally (`compile_step`) the decode step is compiled with `torch.compile` first, so each layer's elementwise
  operations (norms, rotary embedding, activations, residual adds) run as a few fused kernels instead of dozens: a
  narrow model's step is mostly such small kernels. It is compiled once with dynamic shapes, so every batch size and
  cache length shares one compiled graph; the arithmetic is the same, so are the samples (float32, on CPU: tested);
- sampling (temperature → top-k → top-p → multinomial, as transformers orders its warpers; argmax at
  temperature 0) runs outside the graph with an explicit `torch.Generator`; finished sequences keep decoding
  padding and the loop stops when all have finished: it reads whether they had `DONE_LAG` steps earlier
  (`DoneWatch`: each step's flag copied to the host asynchronously), so it never stalls the device and runs at most
  `DONE_LAG` steps past the turn's end (it checked every `CHECK_EVERY` = 16 steps with a device sync before: up to
  15 steps of the whole batch past each turn's end);
- optionally (`compact_rows`, generator.compact_decode_rows; 0 = off, the default) the tail of a turn decodes only
  its running rows: a turn runs until its longest sample ends, and on SmolLM2 in most PPO steps a few samples run to
  the 256-token cap while the rest ended ~100–150 steps earlier, each of those steps costing the whole batch's
  2.3–3.4 ms (H200). Once the rows still running, as the host sees them `DONE_LAG` steps late (`DoneWatch` copies
  the `done` vector), are at most `compact_rows` in a larger batch, the call moves them once to a decode state of
  `compact_rows` rows over a small KV storage of its own (`_CompactRows`: their keys copied in, and back into their
  own rows when the call ends, so the kept buffer and the reused prefix cache see the keys they would have
  without it; the other rows' keys are never touched). That state (and its CUDA graph) is kept as the call's states
  are, and attends with `split_kv` where the call uses `split_kv_shared` (its rows need not share a prefix). The
  sampler still draws on all B rows' logits each step (the compact rows' logits put into their rows, the other rows
  keeping finite stale ones, masked to padding): every random draw, and every sample, is the same (float32 on CPU:
  tested; on an H200 too, in its GPU tests). Turn by turn only (pipelined turns keep their rows busy); not yet timed.

Supports decoder-only models whose attention layers call `past_key_values.update(key, value, layer_idx)` and
dispatch through transformers' attention interface (Llama, Qwen2, Mistral, ...); not sliding-window layers.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from SPA_agent.generators.base import SamplingParams

ATTENTION_NAME = "spa_decode_attention"
#: keyword argument the decode step passes down to the attention layers: (kv_lengths (B,) int32, cu_seqlens_q
#: (B+1,) int32 of the grouped queries, b·G, cu_seqlens_k (B+1,) int32, b·L, the kernel: one of ATTENTION_KERNELS),
#: see `flash_decode`
DECODE_KWARG = "spa_decode"
#: keyword argument of a suffix prefill (a `SuffixPrefill`): prompt suffixes packed into one sequence, each attending to
#: its cache row's keys before it (turn_pipeline.py, generator.reuse_prefix_cache), see `suffix_attention`
SUFFIX_KWARG = "spa_suffix"
#: keyword argument the decode step passes down with the `split_kv_shared` kernel: (shared_lengths (B,) int32,
#: groups (N, MEMBERS) int32), the prefix tables of shared_prefix_decode.py (None with the other kernels)
PREFIX_KWARG = "spa_shared_prefix"
#: decode attention kernels: `flash` (flash attention's variable-length forward where it runs, masked SDPA elsewhere),
#: `split_kv` (split_kv_decode.py, Triton) or `split_kv_shared` (shared_prefix_decode.py: split_kv reading a prefix
#: that a group of rows shares once for the group)
ATTENTION_KERNELS = ("flash", "split_kv", "split_kv_shared")
SHARED_KERNEL = "split_kv_shared"
# On GPU, cache lengths are multiples of this, so batches of similar length share a graph.
PROMPT_BUCKET = 64
#: with keep_graphs: decode states hold a multiple of this many rows (the rest are padding rows)
BATCH_BUCKET = 16
#: with keep_graphs: a call longer than the KV buffer grows its keys per row at least this many times
CAPACITY_GROWTH = 2
CHECK_EVERY = 16  # pipelined turns: decode steps between checks for rows whose turn ended (turn_pipeline.py)
#: the decode loop stops when every row had finished this many steps earlier (`DoneWatch`)
DONE_LAG = 2
#: prompt tokens (rows × chunk width) a prefill forward by default (generator.prefill_chunk_tokens); at least one row. A
#: forward costs the host about the same at any size (a narrow model's prefill is bound by its kernel launches), so
#: larger chunks take fewer forwards; each holds ~8 kB of activations a token for SmolLM2 (~26 kB for 1.5B)
PREFILL_TOKENS = 32768


@functools.cache
def _flash_capable(device: torch.device) -> bool:
    """PyTorch's flash attention kernels need an Ampere or newer NVIDIA GPU (compute capability 8.0)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 8


def uses_flash_decode(query: torch.Tensor) -> bool:
    """Whether decode attention for this query runs flash attention's variable-length kernel (an Ampere or newer
    CUDA GPU, half precision, a head size flash attention supports)."""
    head_dim = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and _flash_capable(query.device))


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention for the static decoder, registered in transformers' AttentionInterface.

    Prefill (several query tokens; `spa_decode` absent): the chunk's own right-padded rows, causal SDPA.
    Suffix prefill (`spa_suffix` given): packed prompt suffixes against their rows of the cache (`suffix_attention`).
    Decode (one query token, `spa_decode` given): query (B, H, 1, D) against the whole cache, key/value
    (B, L, H_kv, D); row b attends to its first kv_lengths[b] keys. Returns (B, q, H, D) and no attention weights,
    as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    suffix = kwargs.get(SUFFIX_KWARG)
    if suffix is not None:
        return suffix_attention(query, key, value, suffix, scaling), None
    decode = kwargs.get(DECODE_KWARG)
    if decode is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling)
    kv_lengths, cu_q, cu_k, kernel = decode
    if kernel == "split_kv":
        from SPA_agent.generators.split_kv_decode import split_kv_decode

        return split_kv_decode(query, key, value, kv_lengths, scaling), None
    if kernel == SHARED_KERNEL:
        from SPA_agent.generators.shared_prefix_decode import shared_prefix_decode

        return shared_prefix_decode(query, key, value, kv_lengths, kwargs[PREFIX_KWARG], scaling), None
    if uses_flash_decode(query):
        return flash_decode(query, key, value, kv_lengths, cu_q, cu_k, scaling), None
    return masked_decode(query, key, value, kv_lengths, scaling), None


def grouped_queries(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Decode queries (B, H, 1, D) as G = H / H_kv query *positions* of H_kv heads per row, (B·G, H_kv, D): the
    G query heads that share a key/value head become G queries of that head. Row b's queries are positions
    [b·G, (b+1)·G), each reading the row's keys without a causal mask, so a kernel reads every key/value once per
    row and key/value head instead of once per query head. Query head h uses key/value head h // G, as in
    transformers' `repeat_kv`."""
    batch, heads, _, head_dim = query.shape
    group = heads // kv_heads
    return query.view(batch, kv_heads, group, head_dim).transpose(1, 2).reshape(batch * group, kv_heads, head_dim)


def ungrouped_output(output: torch.Tensor, batch: int) -> torch.Tensor:
    """The attention output of `grouped_queries`, (B·G, H_kv, D), back in head order: (B, 1, H, D)."""
    _, kv_heads, head_dim = output.shape
    group = output.shape[0] // batch
    return output.view(batch, group, kv_heads, head_dim).transpose(1, 2).reshape(batch, 1, group * kv_heads, head_dim)


def flash_decode(query, key, value, kv_lengths, cu_q, cu_k, scaling=None) -> torch.Tensor:
    """Flash attention's variable-length kernel: query (B, H, 1, D), cache (B, L, H_kv, D), row b reading its
    first kv_lengths[b] keys; (B, 1, H, D). The query heads sharing a key/value head run as that head's G query
    positions (`grouped_queries`; cu_q = b·G), so each key/value is read once per row and head, not G times."""
    batch, heads, _, head_dim = query.shape
    length, kv_heads = key.shape[1], key.shape[2]
    output = torch.ops.aten._flash_attention_forward(
        grouped_queries(query, kv_heads), key.view(batch * length, kv_heads, head_dim),
        value.view(batch * length, kv_heads, head_dim), cu_q, cu_k, heads // kv_heads, length, 0.0, False, False,
        scale=scaling, seqused_k=kv_lengths,
    )[0]
    return ungrouped_output(output, batch)


def masked_decode(query, key, value, kv_lengths, scaling=None) -> torch.Tensor:
    """The same attention as `flash_decode` on any device: one SDPA call whose query rows are the G query heads
    sharing a key/value head, keys past each row's length masked; (B, 1, H, D)."""
    batch, heads, _, head_dim = query.shape
    length, kv_heads = key.shape[1], key.shape[2]
    keys = torch.arange(length, device=key.device) < kv_lengths[:, None]  # (B, L)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    output = F.scaled_dot_product_attention(grouped, key.transpose(1, 2), value.transpose(1, 2),
                                            attn_mask=keys[:, None, None, :], scale=scaling)
    return output.reshape(batch, heads, 1, head_dim).transpose(1, 2)


@dataclass
class SuffixPrefill:
    """Prompt suffixes packed into one sequence (SUFFIX_KWARG): suffix i is its prompt's positions
    [offsets[i], ends[i]), prefilled into cache row rows[i], which already holds the prompt's keys [0, offsets[i]).
    Rows ascending (so the flat cache starts in `cu_k` ascend, as flash attention's offsets do)."""

    rows: list[int]
    offsets: list[int]
    ends: list[int]
    positions: torch.Tensor  # (1, T) the packed tokens' positions in their prompts
    writes: torch.Tensor  # (T,) their flat cache positions, rows[i]·L + position
    cu_q: torch.Tensor  # (n+1,) int32: suffix i is packed tokens [cu_q[i], cu_q[i+1])
    cu_k: torch.Tensor  # (n+1,) int32: row rows[i] starts at flat key cu_k[i] (= rows[i]·L; the last, its row's end)
    used_k: torch.Tensor  # (n,) int32: the keys suffix i reads, ends[i]
    longest_suffix: int
    longest_prompt: int

    @classmethod
    def build(cls, rows: list[int], offsets: list[int], ends: list[int], max_len: int,
              device: torch.device) -> SuffixPrefill:
        positions = torch.cat([torch.arange(offset, end) for offset, end in zip(offsets, ends)])
        counts = torch.tensor([end - offset for offset, end in zip(offsets, ends)])
        row_starts = torch.tensor(rows) * max_len
        cu_q = F.pad(counts.cumsum(0), (1, 0))
        cu_k = torch.cat([row_starts, row_starts[-1:] + max_len])
        return cls(rows, offsets, ends, positions[None].to(device),
                   (row_starts.repeat_interleave(counts) + positions).to(device),
                   cu_q.to(device, torch.int32), cu_k.to(device, torch.int32),
                   torch.tensor(ends, dtype=torch.int32, device=device), int(counts.max()), max(ends))

    @property
    def last_tokens(self) -> torch.Tensor:
        """(n,) the packed index of each suffix's last token (its prompt's last position)."""
        return self.cu_q[1:].long() - 1


def suffix_attention(query, key, value, suffix: SuffixPrefill, scaling=None) -> torch.Tensor:
    """Attention of a suffix prefill: query (1, H, T, D), the packed suffixes; key/value the cache (B, L, H_kv, D),
    the suffixes' own keys already written. The query at position j of row r attends to the row's keys [0, j]:
    causal, aligned to the row's last key (bottom right). On an Ampere or newer CUDA GPU in half precision
    (`uses_flash_decode`): flash attention's variable-length kernel, one call for every suffix, reading the keys in
    place (`flash_suffix`); elsewhere (CPU, float32) one masked SDPA call per suffix (`masked_suffix`).
    Returns (1, T, H, D)."""
    if uses_flash_decode(query):
        return flash_suffix(query, key, value, suffix, scaling)
    return masked_suffix(query, key, value, suffix, scaling)


def flash_suffix(query, key, value, suffix: SuffixPrefill, scaling=None) -> torch.Tensor:
    """`suffix_attention` by flash attention's variable-length forward: suffix i's queries are packed rows
    [cu_q[i], cu_q[i+1]), its keys the first ends[i] of its cache row (seqused_k), and `is_causal` with fewer queries
    than keys aligns the mask to the bottom right, so query j of the suffix reads keys [0, offsets[i] + j]."""
    rows, length, kv_heads, head_dim = key.shape
    output = torch.ops.aten._flash_attention_forward(
        query[0].transpose(0, 1), key.view(rows * length, kv_heads, head_dim),
        value.view(rows * length, kv_heads, head_dim), suffix.cu_q, suffix.cu_k, suffix.longest_suffix,
        suffix.longest_prompt, 0.0, True, False, scale=scaling, seqused_k=suffix.used_k,
    )[0]
    return output[None]


def masked_suffix(query, key, value, suffix: SuffixPrefill, scaling=None) -> torch.Tensor:
    """`suffix_attention` on any device: per suffix, one SDPA call of its queries against its row's first ends[i]
    keys, key k visible to the query at position j where k <= j."""
    outputs, start = [], 0
    for row, offset, end in zip(suffix.rows, suffix.offsets, suffix.ends):
        queries = query[0, :, start : start + end - offset]  # (H, s, D)
        visible = torch.arange(end, device=key.device) <= torch.arange(offset, end, device=key.device)[:, None]
        output = F.scaled_dot_product_attention(queries, key[row, :end].transpose(0, 1),
                                                value[row, :end].transpose(0, 1), attn_mask=visible,
                                                scale=scaling, enable_gqa=True)
        outputs.append(output.transpose(0, 1))
        start += end - offset
    return torch.cat(outputs)[None]


def _register_attention() -> None:
    from transformers import AttentionInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, decode_attention)


@contextlib.contextmanager
def decode_attention_mode(model) -> Iterator[None]:
    """Route the model's attention layers through `decode_attention` for the duration. With no mask function
    registered for it, transformers hands the layers no mask."""
    _register_attention()
    previous = model.config._attn_implementation
    model.config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        model.config._attn_implementation = previous


def _cache_base():
    from transformers.cache_utils import Cache

    return Cache


class KVStorage:
    """Keys and values of every layer, (rows, max_len, H_kv, D) each, allocated at a layer's first write (in its
    head count, size and dtype). A decode state of b ≤ rows rows uses the first b rows: their row stride is
    max_len, so row r's keys start at flat position r·max_len in that view too."""

    def __init__(self, rows: int, max_len: int):
        self.rows, self.max_len = rows, max_len
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
              rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s keys and values, their first `rows` rows."""
        if layer_idx == len(self.keys):
            _, kv_heads, _, head_dim = key_states.shape
            shape = (self.rows, self.max_len, kv_heads, head_dim)
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros(shape))
        return self.keys[layer_idx][:rows], self.values[layer_idx][:rows]

    def copy_rows(self, sources: torch.Tensor, targets: torch.Tensor, width: int) -> None:
        """Rows `targets` take rows `sources`' first `width` keys and values, in every layer (a copy on the device; the
        sources are read whole before any target is written, so the two may overlap)."""
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[targets, :width] = buffer[sources, :width]

    def allocate_like(self, other: KVStorage) -> None:
        """Every layer's keys and values, of `other`'s head count, size and dtype, allocated now: rows can be copied
        in (`copy_rows_to`) before this storage's first forward."""
        for buffers, others in ((self.keys, other.keys), (self.values, other.values)):
            buffers.extend(buffer.new_zeros((self.rows, self.max_len, *buffer.shape[2:])) for buffer in others)

    def copy_rows_to(self, rows: torch.Tensor, target: KVStorage, target_rows: torch.Tensor) -> None:
        """Rows `target_rows` of `target` (as many keys a row) take this storage's rows `rows`, whole, in every
        layer (a copy on the device)."""
        for source, into in zip(self.keys + self.values, target.keys + target.values):
            into[target_rows] = source[rows]

    def gather_rows(self, rows: list[int]) -> None:
        """Row i takes row rows[i]'s keys and values, in every layer (a copy on the device; any order)."""
        if self.keys and rows != list(range(len(rows))):
            device = self.keys[0].device
            self.copy_rows(torch.tensor(rows, device=device), torch.arange(len(rows), device=device), self.max_len)


class StaticKVCache(_cache_base()):
    """The first `batch` rows of a KVStorage, (B, L, H_kv, D) per layer.

    Implements the part of transformers' Cache API that attention layers use (`update`); it subclasses `Cache`
    only so that type checks in model code accept it, and initialises none of its dynamic state.
    While `prefill_rows` is set (row indices), the prompts' keys/values go to those rows at positions [0, P) and are
    returned as they are; while `packed_writes` is set (a suffix prefill, `SuffixPrefill.writes`), the packed
    tokens' keys/values go to those flat positions and the buffers are returned; a decode step writes row b's
    key/value at flat position `write_rows[b]` = b·L + its position (a (B,) tensor, updated in place between
    CUDA-graph replays) and returns the buffers.
    """

    def __init__(self, batch: int, storage: KVStorage, write_rows: torch.Tensor):
        self.batch, self.max_len, self.storage, self.write_rows = batch, storage.max_len, storage, write_rows
        self.prefill_rows: torch.Tensor | None = None
        self.packed_writes: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.storage.layer(layer_idx, key_states, value_states, self.batch)
        if self.prefill_rows is not None:
            width = key_states.shape[2]
            keys[self.prefill_rows, :width] = key_states.transpose(1, 2)
            values[self.prefill_rows, :width] = value_states.transpose(1, 2)
            return key_states, value_states
        flat = (self.batch * self.max_len, *keys.shape[2:])
        if self.packed_writes is not None:
            keys.view(flat).index_copy_(0, self.packed_writes, key_states[0].transpose(0, 1))
            values.view(flat).index_copy_(0, self.packed_writes, value_states[0].transpose(0, 1))
            return keys, values
        keys.view(flat).index_copy_(0, self.write_rows, key_states[:, :, 0])
        values.view(flat).index_copy_(0, self.write_rows, value_states[:, :, 0])
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' TopK then TopP warpers: logits (B, V) with filtered entries set to -inf."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - top_p
        remove[:, -1] = False  # keep at least the most likely token
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Next token per row, (B,), from float32 logits (B, V)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    logits = filter_logits(logits, params.top_k, params.top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


@dataclass
class DecodeStats:
    """What the decoder computed since it was built (benchmarks read and reset it)."""

    prefill_tokens: int = 0  # prompt positions run through prefill, padding of each chunk included
    reused_tokens: int = 0  # prompt positions not prefilled: their keys were in the row's cache (reuse_prefix_cache)
    copied_tokens: int = 0  # prompt positions not prefilled: copied from an identical prompt's row (split_kv_shared)
    decode_steps: int = 0  # one-token forward passes of the decode batch (compact_steps of them on its running rows)
    compact_steps: int = 0  # decode steps run on the compact state of the running rows only (compact_rows)
    compact_graph_steps: int = 0  # of those, replays of the compact state's CUDA graph (on GPU: every one)
    capture_s: float = 0.0  # seconds spent capturing CUDA graphs
    states_built: int = 0  # decode states built (on GPU a CUDA graph each); keep_graphs reuses them across calls


class DoneWatch:
    """Whether every row of a decode loop had finished DONE_LAG steps ago, read without stalling the device.

    Each step's `done` vector goes to the host by an asynchronous copy (pinned memory, an event after it); reading
    the vector of DONE_LAG steps back waits, if at all, only for that step's work, while the later steps are queued.
    So the host stays at most DONE_LAG steps ahead of the device and the loop stops DONE_LAG steps after the last
    row's end of turn. (A check every step with a sync would leave the device idle while the host queues the next
    step.) The rows past their end decode padding, as finished rows do, so the tokens are the same at any lag. The
    vector read is kept (`seen`), so the loop knows, as late, which rows still run (`StaticDecoder.compact_rows`)."""

    def __init__(self, device: torch.device, lag: int = DONE_LAG):
        self.lag, self.step = lag, 0
        self.on_cuda = device.type == "cuda"
        self.flags: torch.Tensor | None = None  # (lag, B), allocated at the first step's B
        self.events = [torch.cuda.Event() for _ in range(lag)] if self.on_cuda else []
        self.seen: torch.Tensor | None = None  # (B,) on the host: `done` of `lag` steps ago (None before)

    def all_done_before(self, done: torch.Tensor) -> bool:
        """Record this step's `done`; whether every row had finished `lag` steps ago."""
        if self.flags is None:
            self.flags = torch.zeros((self.lag, *done.shape), dtype=torch.bool, pin_memory=self.on_cuda)
        slot, self.step = self.step % self.lag, self.step + 1
        if self.step > self.lag:
            if self.on_cuda:
                self.events[slot].synchronize()
            self.seen = self.flags[slot].clone()  # the slot is overwritten below, asynchronously
        self.flags[slot].copy_(done, non_blocking=self.on_cuda)
        if self.on_cuda:
            self.events[slot].record()
        return self.seen is not None and bool(self.seen.all())


class _DecodeState:
    """Buffers of one (B, L) shape (the first B rows of a KVStorage of L keys a row) and, on GPU, the CUDA graph of
    one decode step over them."""

    def __init__(self, model, batch: int, storage: KVStorage, use_cuda_graph: bool, step_fn=None,
                 attention="flash"):
        device, max_len = next(model.parameters()).device, storage.max_len
        self.model, self.shape = model, (batch, max_len)
        self.input_ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)  # of the token being fed
        rows = torch.arange(batch + 1, dtype=torch.int32, device=device)
        heads = model.config.num_attention_heads
        group = heads // (getattr(model.config, "num_key_value_heads", None) or heads)  # query heads per kv head
        self.row_starts = rows[:-1].long() * max_len
        self.write_rows = torch.zeros(batch, dtype=torch.long, device=device)
        self.kv_lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)  # rows that emitted an end of turn
        # DECODE_KWARG: lengths, cu_seqlens of the grouped queries (G a row) and of the keys, the kernel
        self.decode = (self.kv_lengths, rows * group, rows * max_len, attention)
        self.prefixes = None  # with split_kv_shared, the rows' shared prefixes (`share_prefixes`)
        if attention == SHARED_KERNEL:
            from SPA_agent.generators.shared_prefix_decode import PrefixTables

            self.prefixes = PrefixTables(batch, device)
        self.prefix_tensors = None if self.prefixes is None else self.prefixes.tensors  # PREFIX_KWARG
        self.cache = StaticKVCache(batch, storage, self.write_rows)
        self.graph, self.logits = None, None
        self.capture_s = 0.0
        self._use_cuda_graph = use_cuda_graph
        self._step_fn = step_fn or _DecodeState.forward_step

    def forward_step(self) -> torch.Tensor:
        """One decode step on the buffers: (B, V) float32 logits of the next token."""
        self.write_rows.copy_(self.row_starts + self.positions)
        self.kv_lengths.copy_((self.positions + 1).masked_fill_(self.finished, 1))  # a finished row reads one key
        output = self.model(
            input_ids=self.input_ids,
            position_ids=self.positions[:, None],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
            **{DECODE_KWARG: self.decode, PREFIX_KWARG: self.prefix_tensors},
        )
        return output.logits[:, -1].float()

    def step(self) -> torch.Tensor:
        if self.graph is None:
            return self._step_fn(self)
        self.graph.replay()
        return self.logits

    def share_prefixes(self, prompts: list[list[int]]) -> None:
        """With split_kv_shared: the call's rows whose prompts start with the same ids read that prefix once per
        group (shared_prefix_decode.py; the rows past the call's share nothing). Nothing with other kernels."""
        if self.prefixes is not None:
            from SPA_agent.generators.shared_prefix_decode import shared_prefixes

            self.prefixes.fill(*shared_prefixes(prompts))

    def pad_rows(self, batch: int) -> None:
        """Rows from `batch` on are padding (keep_graphs' batch bucket): finished from the start, so each reads one
        key, at position 0 of its own row; nothing samples their logits."""
        self.finished[batch:] = True
        self.positions[batch:] = 0

    def capture(self) -> None:
        """On GPU, record one decode step in a CUDA graph (once per state). Runs before the prefill, which
        overwrites the cache positions that warm-up and capture wrote to."""
        if not self._use_cuda_graph or self.graph is not None:
            return
        start = time.perf_counter()
        self.positions.fill_(self.shape[1] - 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # (a compiled step compiles here, on its first call)
                self._step_fn(self)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step_fn(self)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as a long tensor on `device`; to a GPU from pinned memory without waiting (a pageable copy would
    wait for the device's queued decode steps)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class _CompactRows:
    """A decode loop's running rows (`rows` of its B), decoded in the compact state (`StaticDecoder.compact_rows`).

    The compact state's rows [0, n) take the rows' keys and values from the call's storage, whole; its rows past n
    are padding (finished from the start). Each step feeds them their sampled tokens at their positions and returns
    (B, V) logits: the compact rows' put into their rows, the other rows keeping the finite logits they had at the
    switch (they are finished, so their samples are masked to padding), so the sampler draws for all B rows as
    before. `put_back` copies the rows back, whole, into their own rows of the call's storage."""

    def __init__(self, state: _DecodeState, compact: _DecodeState, rows: list[int], logits: torch.Tensor,
                 prompt_lengths: torch.Tensor):
        self.state, self.compact, self.count = state, compact, len(rows)
        self.rows = to_device(rows, logits.device)
        self.places = torch.arange(self.count, device=logits.device)
        self.lengths = prompt_lengths[self.rows]
        self.logits = logits.clone()  # (a CUDA graph's output is overwritten by its next replay)
        state.cache.storage.copy_rows_to(self.rows, compact.cache.storage, self.places)
        compact.pad_rows(self.count)

    def step(self, next_tokens: torch.Tensor, step: int, done: torch.Tensor) -> torch.Tensor:
        """One decode step of the compact rows; (B, V) logits of every row's next token."""
        count = self.count
        self.compact.finished[:count].copy_(done[self.rows])
        self.compact.input_ids[:count, 0].copy_(next_tokens[self.rows])
        self.compact.positions[:count].copy_(self.lengths + step)
        return self.logits.index_copy_(0, self.rows, self.compact.step()[:count])

    def put_back(self) -> None:
        """The rows' keys and values, those written here included, back into their rows of the call's storage."""
        self.compact.cache.storage.copy_rows_to(self.places, self.state.cache.storage, self.rows)


def left_aligned(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (B, P) moved to the start of their rows (padding on the right); and their lengths."""
    lengths = attention_mask.sum(dim=1)
    width = input_ids.shape[1]
    columns = torch.arange(width, device=input_ids.device)[None] + (width - lengths)[:, None]
    moved = input_ids.gather(1, columns.clamp(max=width - 1))
    return moved.masked_fill(columns >= width, pad_id), lengths


class StaticDecoder:
    """Decodes padded batches with a static KV cache; see the module docstring (`keep_graphs` there too)."""

    def __init__(self, model, stop_ids: list[int], pad_id: int, use_cuda_graphs: bool = True,
                 compile_step: bool = False, attention: str = "flash", keep_graphs: bool = False,
                 prefill_chunk_tokens: int | None = None, compact_rows: int = 0):
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"decode attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
        self.prefill_chunk_tokens = PREFILL_TOKENS if prefill_chunk_tokens is None else prefill_chunk_tokens
        layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or getattr(model.config, "use_sliding_window", False):
            raise ValueError(
                "the static decoder supports full-attention models only; set generator.decoder=generate"
            )
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.attention, self.keep_graphs = attention, keep_graphs
        self.compact_rows = compact_rows  # a call's running rows decoded apart once this few remain (0: never)
        self.stop_ids = torch.tensor(stop_ids, device=self.device)
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        # one compiled step for every (B, L): dynamic shapes, so a new batch size or cache length does not recompile
        self._step_fn = torch.compile(_DecodeState.forward_step, dynamic=True) if compile_step else None
        self._storage: KVStorage | None = None
        self._states: dict[int, _DecodeState] = {}  # by rows: every state reads the first rows of _storage
        self._compact: _DecodeState | None = None  # of compact_rows rows over a storage of its own (`_compact_state`)
        self._weight_addresses: list[int] = []  # with keep_graphs: the weights' addresses the states were built at
        self.last_capture_s = 0.0  # seconds the last call spent capturing CUDA graphs
        self.stats = DecodeStats()

    def release(self) -> None:
        """Free the KV buffers and the CUDA graphs (they are rebuilt on the next call)."""
        self._states.clear()
        self._compact = None
        self._storage = None

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
        prompt_ids: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Sampled ids (B, max_new_tokens) for left-padded prompts (B, P); after a sequence's end-of-turn
        token its row holds `pad_id`. split_kv_shared compares the prompts' ids on the host: `prompt_ids`, the same
        prompts unpadded, if the caller has them (else copied from the device)."""
        prompts, lengths = left_aligned(input_ids, attention_mask, self.pad_id)
        state = self._call_state(prompts.shape[0], prompts.shape[1] + params.max_new_tokens)
        if self.attention != SHARED_KERNEL:
            return self._run(state, lambda: self._prefill(state, prompts, lengths), lengths, params, generator)
        if prompt_ids is None:
            prompt_ids = [ids[:length] for ids, length in zip(prompts.tolist(), lengths.tolist())]
        return self._run(state, lambda: self._prefill_once(state, prompts, lengths, prompt_ids), lengths, params,
                         generator, prompt_ids)

    def _call_state(self, batch: int, max_len: int) -> _DecodeState:
        """The decode state of a call of `batch` prompts needing `max_len` keys a row (CUDA graphs: rounded up to
        PROMPT_BUCKET, so that calls of similar lengths share a graph)."""
        if self.use_cuda_graphs:
            max_len += -max_len % PROMPT_BUCKET
        if self.keep_graphs:
            self._follow_weights()
        return self._state_for(batch, max_len)

    def _run(self, state: _DecodeState, prefill, lengths: torch.Tensor, params: SamplingParams,
             generator: torch.Generator, prompt_ids: list[list[int]] | None = None) -> torch.Tensor:
        """Capture the state's graph (once), prefill (`prefill()`: the first new tokens' logits) and decode the
        call's rows, the prompts of `lengths` (their ids `prompt_ids`, which split_kv_shared needs: the prefixes
        they share are read once); (B, max_new_tokens) sampled ids."""
        captured_before, self.last_capture_s = state.capture_s, 0.0  # (`_compact_state` adds its capture)
        with decode_attention_mode(self.model):
            state.capture()
            state.pad_rows(len(lengths))
            state.share_prefixes(prompt_ids or [])
            logits = prefill()
            tokens = self._decode(state, logits, lengths, params, generator)
        self.last_capture_s += state.capture_s - captured_before
        self.stats.capture_s += state.capture_s - captured_before
        return tokens

    def _follow_weights(self) -> None:
        """Kept CUDA graphs read the weights at the addresses they were captured with: updates in place (an
        optimizer step, `copy_`) reach them, tensors put in the weights' place would not, so new addresses drop
        every state."""
        addresses = [t.data_ptr() for t in itertools.chain(self.model.parameters(), self.model.buffers())]
        if addresses != self._weight_addresses:
            self.release()
            self._weight_addresses = addresses

    def _state_for(self, batch: int, max_len: int) -> _DecodeState:
        """A decode state of at least `batch` rows and `max_len` keys a row: exactly that shape, or with
        keep_graphs the state of the batch rounded up to BATCH_BUCKET over the shared buffer."""
        rows = -(-batch // BATCH_BUCKET) * BATCH_BUCKET if self.keep_graphs else batch
        if self.keep_graphs:
            self._reserve(rows, max_len)
        elif self._storage is None or (self._storage.rows, self._storage.max_len) != (batch, max_len):
            self.release()  # free the old buffers before allocating new ones
            self._storage = KVStorage(batch, max_len)
        if rows not in self._states:
            self._states[rows] = _DecodeState(self.model, rows, self._storage, self.use_cuda_graphs, self._step_fn,
                                              self.attention)
            self.stats.states_built += 1
        return self._states[rows]

    def _reserve(self, rows: int, max_len: int) -> None:
        """Grow the shared KV buffer (keep_graphs) to hold `rows` rows of `max_len` keys: rows to what is asked,
        keys at least CAPACITY_GROWTH-fold. A new buffer drops every state: their graphs read the old one."""
        storage = self._storage
        if storage is not None:
            if rows <= storage.rows and max_len <= storage.max_len:
                return
            if max_len > storage.max_len:
                max_len = max(max_len, CAPACITY_GROWTH * storage.max_len)
            rows, max_len = max(rows, storage.rows), max(max_len, storage.max_len)
        del storage  # the last reference but the decoder's: `release` frees the old buffer before the new one
        self.release()
        self._storage = KVStorage(rows, max_len)

    def _prefill(self, state: _DecodeState, prompts: torch.Tensor, lengths: torch.Tensor,
                 cache_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run the right-padded prompts (B, P) causally in row chunks of at most `prefill_chunk_tokens` tokens,
        longest prompts first, each chunk cut to its own longest prompt, filling the cache (prompt i into cache row
        `cache_rows[i]`, default i); (B, V) logits of the first new token, in the rows' order. Chunks of similar
        lengths run little padding: a turn's histories differ by their earlier answers (up to the token cap each),
        so a chunk of rows in batch order was mostly as wide as the longest prompt of the batch."""
        decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
        host_lengths = lengths.tolist()
        order = sorted(range(len(host_lengths)), key=lambda row: -host_lengths[row])
        logits, start = [], 0
        try:
            while start < len(order):
                width = host_lengths[order[start]]
                rows = torch.tensor(order[start : start + max(1, self.prefill_chunk_tokens // width)], device=self.device)
                state.cache.prefill_rows = rows if cache_rows is None else cache_rows[rows]
                input_ids = prompts[rows, :width]
                self.stats.prefill_tokens += input_ids.numel()
                hidden = decoder(
                    input_ids=input_ids,
                    position_ids=torch.arange(width, device=self.device).expand_as(input_ids),
                    past_key_values=state.cache,
                    use_cache=True,
                ).last_hidden_state
                last = hidden[torch.arange(hidden.shape[0], device=self.device), lengths[rows] - 1]
                logits.append(head(last).float())
                start += len(rows)
        finally:
            state.cache.prefill_rows = None
        return torch.cat(logits)[torch.argsort(torch.tensor(order, device=self.device))]

    def _prefill_once(self, state: _DecodeState, prompts: torch.Tensor, lengths: torch.Tensor,
                      prompt_ids: list[list[int]], cache_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`_prefill` with each distinct prompt (ids `prompt_ids`) prefilled once, into the row of its first
        occurrence, and its keys and values copied to its repeats' rows (split_kv_shared: a PPO batch repeats each
        prompt of turn 1, SPA 8 times). Same logits and keys as the repeats' own prefill would compute, up to the
        rounding of a forward of other rows."""
        first: dict[tuple[int, ...], int] = {}
        sources = [first.setdefault(tuple(ids), row) for row, ids in enumerate(prompt_ids)]
        if len(first) == len(sources):
            return self._prefill(state, prompts, lengths, cache_rows)
        unique = torch.tensor(list(first.values()), device=self.device)
        rows = unique if cache_rows is None else cache_rows[unique]
        logits = self._prefill(state, prompts[unique], lengths[unique], rows)
        targets = [row for row, source in enumerate(sources) if source != row]
        repeats = torch.tensor(targets, device=self.device)
        copied_from = torch.tensor([sources[row] for row in targets], device=self.device)
        if cache_rows is not None:
            repeats, copied_from = cache_rows[repeats], cache_rows[copied_from]
        self._storage.copy_rows(copied_from, repeats, int(lengths.max()))
        self.stats.copied_tokens += sum(len(prompt_ids[row]) for row in targets)
        position = {row: index for index, row in enumerate(first.values())}
        return logits[torch.tensor([position[source] for source in sources], device=self.device)]

    def _decode(
        self,
        state: _DecodeState,
        logits: torch.Tensor,
        prompt_lengths: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """Sample, feed back, repeat; (B, max_new_tokens) ids with `pad_id` after each end of turn. Once few rows
        still run (`compact_rows`), the rest of the call decodes them alone (`_CompactRows`)."""
        batch = logits.shape[0]  # the state's rows past it are padding (`pad_rows`): never sampled
        tokens = torch.full((batch, params.max_new_tokens), self.pad_id, dtype=torch.long, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        watch = DoneWatch(self.device)
        compact: _CompactRows | None = None
        for step in range(params.max_new_tokens):
            next_tokens = sample(logits, params, generator).masked_fill(done, self.pad_id)
            tokens[:, step] = next_tokens
            done |= torch.isin(next_tokens, self.stop_ids)
            if step == params.max_new_tokens - 1 or watch.all_done_before(done):
                break
            running = self._rows_to_compact(watch.seen) if compact is None else None
            if running is not None:
                compact = _CompactRows(state, self._compact_state(), running, logits, prompt_lengths)
            if compact is None:
                logits = self._step_all(state, next_tokens, prompt_lengths + step, done)
            else:
                logits = compact.step(next_tokens, step, done)
                self.stats.compact_steps += 1
                self.stats.compact_graph_steps += compact.compact.graph is not None
            self.stats.decode_steps += 1
        if compact is not None:
            compact.put_back()
        return tokens

    @staticmethod
    def _step_all(state: _DecodeState, next_tokens: torch.Tensor, positions: torch.Tensor,
                  done: torch.Tensor) -> torch.Tensor:
        """One decode step of the call's B rows (the state's first B) in its state; (B, V) logits."""
        batch = len(next_tokens)
        state.finished[:batch].copy_(done)
        state.input_ids[:batch].copy_(next_tokens[:, None])
        state.positions[:batch].copy_(positions)
        return state.step()[:batch]

    def _rows_to_compact(self, seen: torch.Tensor | None) -> list[int] | None:
        """The rows still running as the host saw them (`DoneWatch.seen`), if compaction is on, the call's batch is
        larger than `compact_rows` and they are at most that many; else None."""
        if not self.compact_rows or seen is None or len(seen) <= self.compact_rows:
            return None
        running = (~seen).nonzero()[:, 0].tolist()
        return running if len(running) <= self.compact_rows else None

    def _compact_state(self) -> _DecodeState:
        """The decode state of `compact_rows` rows over a KV storage of its own, as long as the call's (`release`
        drops it with the call's storage): built, and its graph captured, at its first use. It attends with split_kv
        where the call's state uses split_kv_shared: its rows are whichever still run, sharing no known prefix."""
        if self._compact is None:
            storage = KVStorage(self.compact_rows, self._storage.max_len)
            storage.allocate_like(self._storage)
            attention = "split_kv" if self.attention == SHARED_KERNEL else self.attention
            self._compact = _DecodeState(self.model, self.compact_rows, storage, self.use_cuda_graphs, self._step_fn,
                                         attention)
            self.stats.states_built += 1
            self._compact.capture()
            self.last_capture_s += self._compact.capture_s
            self.stats.capture_s += self._compact.capture_s
        return self._compact

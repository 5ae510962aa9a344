"""A compact decode loop over a transformers causal LM's own forward: static KV cache, CUDA graphs (issue 9).

Why not `model.generate`: with left padding, transformers' SDPA attention receives a mask and then copies
every key/value head `num_attention_heads / num_key_value_heads` times per layer and step (`repeat_kv`), which
dominates decoding time for GQA models at large batch. Here:

- prefill runs the prompts once (the model's forward, SDPA attention; in row chunks of at most PREFILL_TOKENS
  tokens, so a large batch's prefill activations stay small) and writes keys/values into preallocated buffers
  (B, H_kv, L, D), L = padded prompt width + max_new_tokens;
- each decode step feeds one token per sequence; attention treats the G = H / H_kv query heads that share a
  key/value head as G query rows of one SDPA call, so keys and values are read once and never copied;
- on GPU the decode step (forward + mask update) is captured once per (B, L) in a CUDA graph and replayed,
  which removes the per-kernel launch overhead of a 28-layer model;
- sampling (temperature → top-k → top-p → multinomial, as transformers orders its warpers; argmax at
  temperature 0) runs outside the graph with an explicit `torch.Generator`; finished sequences keep decoding
  padding and the loop stops when all have finished (checked every `CHECK_EVERY` steps to avoid a device sync
  per token).

Supports decoder-only models whose attention layers call `past_key_values.update(key, value, layer_idx)` and
dispatch through transformers' attention interface (Llama, Qwen2, Mistral, ...); not sliding-window layers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from SPA_agent.generators.base import SamplingParams

ATTENTION_NAME = "spa_grouped_sdpa"
# On GPU, prompt widths and cache lengths are multiples of this, so chunks of similar length share a graph.
PROMPT_BUCKET = 64
CHECK_EVERY = 16  # decode steps between checks whether every sequence has finished
PREFILL_TOKENS = 32768  # prompt tokens (rows × padded width) per prefill forward; at least one row


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention for the static decoder, registered in transformers' AttentionInterface.

    Decode (one query token): query (B, H, 1, D), key/value (B, H_kv, L, D), attention_mask (B, 1, 1, L) bool.
    The G = H / H_kv query heads of each key/value head become G query rows: one SDPA call over (B, H_kv, G,
    D) reads every key and value once. Prefill (several query tokens) uses transformers' SDPA attention.
    Returns (B, q, H, D) and no attention weights, as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, head_dim = query.shape
    if q_len > 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling
        )
    kv_heads = key.shape[1]
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    output = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return output.reshape(batch, heads, 1, head_dim).transpose(1, 2), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, grouped_sdpa_attention)


@contextlib.contextmanager
def grouped_attention(model) -> Iterator[None]:
    """Route the model's attention layers through `grouped_sdpa_attention` for the duration."""
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


class StaticKVCache(_cache_base()):
    """Preallocated keys/values, (B, H_kv, L, D) per layer, allocated on the first prefill.

    Implements the part of transformers' Cache API that attention layers use (`update`); it subclasses `Cache`
    only so that type checks in model code accept it, and initialises none of its dynamic state.
    While `prefill_rows` is a slice, the prompts' keys/values go to those rows at positions [0, P) and are
    returned as they are; a decode step writes position `write_index` of every row (a (1,) tensor, updated in
    place between CUDA-graph replays) and returns the buffers.
    """

    def __init__(self, batch: int, max_len: int, write_index: torch.Tensor):
        self.batch, self.max_len, self.write_index = batch, max_len, write_index
        self.prefill_rows: slice | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            _, kv_heads, _, head_dim = key_states.shape
            shape = (self.batch, kv_heads, self.max_len, head_dim)
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros(shape))
        if self.prefill_rows is not None:
            self.keys[layer_idx][self.prefill_rows, :, : key_states.shape[2]].copy_(key_states)
            self.values[layer_idx][self.prefill_rows, :, : value_states.shape[2]].copy_(value_states)
            return key_states, value_states
        self.keys[layer_idx].index_copy_(2, self.write_index, key_states)
        self.values[layer_idx].index_copy_(2, self.write_index, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

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


class _DecodeState:
    """Buffers of one (B, L) shape and, on GPU, the CUDA graph of one decode step over them."""

    def __init__(self, model, batch: int, max_len: int, use_cuda_graph: bool):
        device = next(model.parameters()).device
        self.model, self.shape = model, (batch, max_len)
        self.input_ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.position_ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.write_index = torch.zeros(1, dtype=torch.long, device=device)
        self.attend = torch.zeros((batch, max_len), dtype=torch.bool, device=device)
        self.cache = StaticKVCache(batch, max_len, self.write_index)
        self.graph, self.logits = None, None
        self.capture_s = 0.0
        self._use_cuda_graph = use_cuda_graph

    def forward_step(self) -> torch.Tensor:
        """One decode step on the buffers: (B, V) float32 logits of the next token."""
        self.attend.index_fill_(1, self.write_index, True)
        output = self.model(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            attention_mask=self.attend[:, None, None, :],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1].float()

    def step(self) -> torch.Tensor:
        if self.graph is None:
            return self.forward_step()
        self.graph.replay()
        return self.logits

    def capture(self) -> None:
        """On GPU, record one decode step in a CUDA graph (once per state). Runs before the prefill, which
        resets the mask and cache positions that warm-up and capture wrote to."""
        if not self._use_cuda_graph or self.graph is not None:
            return
        start = time.perf_counter()
        self.write_index.fill_(self.shape[1] - 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward_step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.forward_step()
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start


class StaticDecoder:
    """Decodes padded batches with a static KV cache; see the module docstring."""

    def __init__(self, model, stop_ids: list[int], pad_id: int, use_cuda_graphs: bool = True):
        layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or getattr(model.config, "use_sliding_window", False):
            raise ValueError(
                "the static decoder supports full-attention models only; set generator.decoder=generate"
            )
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.stop_ids = torch.tensor(stop_ids, device=self.device)
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self._state: _DecodeState | None = None
        self.last_capture_s = 0.0  # seconds the last call spent capturing CUDA graphs

    def release(self) -> None:
        """Free the KV buffers and the CUDA graph (they are rebuilt on the next call)."""
        self._state = None

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """Sampled ids (B, max_new_tokens) for left-padded prompts (B, P); after a sequence's end-of-turn
        token its row holds `pad_id`."""
        input_ids, attention_mask = self._bucket(input_ids, attention_mask)
        batch, width = input_ids.shape
        max_len = width + params.max_new_tokens
        if self.use_cuda_graphs:  # aligned key length: SDPA's masked kernels want a multiple of 16
            max_len += -max_len % PROMPT_BUCKET
        state = self._state_for(batch, max_len)
        captured_before = state.capture_s
        with grouped_attention(self.model):
            state.capture()
            logits = self._prefill(state, input_ids, attention_mask)
            tokens = self._decode(state, logits, attention_mask.sum(dim=1), width, params, generator)
        self.last_capture_s = state.capture_s - captured_before
        return tokens

    def _bucket(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """Extra left padding up to a multiple of PROMPT_BUCKET (masked, so results are unchanged)."""
        extra = -input_ids.shape[1] % PROMPT_BUCKET if self.use_cuda_graphs else 0
        return F.pad(input_ids, (extra, 0), value=self.pad_id), F.pad(attention_mask, (extra, 0), value=0)

    def _state_for(self, batch: int, max_len: int) -> _DecodeState:
        if self._state is None or self._state.shape != (batch, max_len):
            self._state = None  # free the old buffers before allocating new ones
            self._state = _DecodeState(self.model, batch, max_len, self.use_cuda_graphs)
        return self._state

    def _prefill(
        self, state: _DecodeState, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """Run the prompts (B, P) in row chunks of at most PREFILL_TOKENS tokens, fill the cache, reset the
        decode mask; (B, V) logits of the first new token."""
        width = input_ids.shape[1]
        keys = attention_mask.bool()
        causal = torch.ones((width, width), dtype=torch.bool, device=self.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=self.device)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        rows_per_chunk = max(1, PREFILL_TOKENS // width)
        logits = []
        try:
            for start in range(0, input_ids.shape[0], rows_per_chunk):
                rows = slice(start, start + rows_per_chunk)
                mask = (causal[None] & keys[rows, None, :]) | eye[None]
                state.cache.prefill_rows = rows
                output = self.model(
                    input_ids=input_ids[rows],
                    position_ids=position_ids[rows],
                    attention_mask=mask[:, None],
                    past_key_values=state.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                logits.append(output.logits[:, -1].float())
        finally:
            state.cache.prefill_rows = None
        state.attend.zero_()
        state.attend[:, :width] = keys
        return torch.cat(logits)

    def _decode(
        self,
        state: _DecodeState,
        logits: torch.Tensor,
        prompt_lengths: torch.Tensor,
        width: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """Sample, feed back, repeat; (B, max_new_tokens) ids with `pad_id` after each end of turn."""
        tokens = torch.full(
            (logits.shape[0], params.max_new_tokens), self.pad_id, dtype=torch.long, device=self.device
        )
        done = torch.zeros(logits.shape[0], dtype=torch.bool, device=self.device)
        for step in range(params.max_new_tokens):
            next_tokens = sample(logits, params, generator).masked_fill(done, self.pad_id)
            tokens[:, step] = next_tokens
            done |= torch.isin(next_tokens, self.stop_ids)
            if step == params.max_new_tokens - 1 or (
                step % CHECK_EVERY == CHECK_EVERY - 1 and bool(done.all())
            ):
                break
            state.input_ids.copy_(next_tokens[:, None])
            state.position_ids.copy_((prompt_lengths + step)[:, None])
            state.write_index.fill_(width + step)
            logits = state.step()
        return tokens

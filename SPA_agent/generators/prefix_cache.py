"""The reused prefix cache (`generator.reuse_prefix_cache`, issue 42): a turn's prompt is prefilled only past what its
row of the static decoder's KV cache holds already.

Why: a turn's prompt is the env's whole history (system prompt, earlier turns), so prefilling it from position 0
every turn ran ~980k prompt tokens a PPO step on SmolLM2 (256 trajectories × 5 turns; 1.2–1.8 s of an H200), while
the row's cache already held almost all of it: its previous prompt and the tokens it sampled since.

How: the host keeps, per row, the ids whose keys the row's cache holds as the model computes them: its last prompt,
then every token the turn sampled but the last (`fed_tokens`: the last is an end of turn, fed, if at all, while its
row already counted as finished, so its attention read one key; or the token at the cap, never fed). A next prompt
keeps the common prefix of the two, p ids (`reusable_length`; at most all but the prompt's last id, whose position
gives the first new token's logits), and only positions [p, n) are prefilled: the suffixes packed into one sequence
(at most `prefill_chunk_tokens` tokens a forward), each token at its own position, attending to its row's keys
[0, its position] (`static_decode.suffix_attention`: flash attention's variable-length kernel on a GPU in half
precision, masked SDPA elsewhere). Exactness: the ids are compared exactly, so a prompt that renders the sampled
response differently (another tokenization, an edited history) reuses only up to the first differing id, p = 0
being the whole prefill; the reused keys are those a prefill of the same ids at the same positions computes (in
float32 the first new token's logits equal a whole prefill's within 1e-5 of their scale, and greedy turns are the
same: tested). `DecodeStats.prefill_tokens` counts the positions run, `reused_tokens` those kept.

Two ways to use it:
- pipelined turns (turn_pipeline.py): one row serves one env for the whole rollout;
- turn by turn, one `generate_turn` call a turn, with kept decode graphs (`keep_graphs`: the KV buffer outlives the
  calls). Each prompt names its conversation (`Prompt.conversation`: the agent proxy's rollout and env); a call whose
  every conversation continues one the buffer holds moves those rows to the front, in the call's order (a copy of
  their keys on the device: the envs that finished drop out, and the decode batch is sorted by prompt length), and
  prefills only the suffixes. Any other call (a new rollout, a buffer regrown or dropped since, new weights) prefills
  its prompts whole. The call's batch, its order, its decode state and its random draws are those of `generate`, so
  its samples are too (greedy turns tested equal on CPU).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from SPA_agent.generators.base import SamplingParams
from SPA_agent.generators.static_decode import (
    SHARED_KERNEL,
    SUFFIX_KWARG,
    StaticDecoder,
    SuffixPrefill,
    _DecodeState,
)


class PrefixCachedDecoder(StaticDecoder):
    """A static decoder whose prefills can start where a row's cache departs from the prompt (module docstring)."""

    def __init__(self, *args, reuse_prefix_cache: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.reuse_prefix_cache = reuse_prefix_cache
        self._stop_set = set(self.stop_ids.tolist())
        # what the last `generate_turn` left in the KV buffer: its conversations' rows, each row's cached ids, and
        # the buffer they are in (a buffer regrown or dropped since holds none of them)
        self._rows_of: dict[Hashable, int] = {}
        self._cached: list[list[int]] = []
        self._cached_in = None

    def release(self) -> None:
        """Free the KV buffers and the CUDA graphs; the rows' conversations go with them (and no reference to the old
        buffer stays, so it is freed before a regrown one is allocated)."""
        self._rows_of, self._cached, self._cached_in = {}, [], None
        super().release()

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator, prompt_ids: list[list[int]] | None = None) -> torch.Tensor:
        self._rows_of = {}  # this call overwrites the rows
        return super().generate(input_ids, attention_mask, params, generator, prompt_ids)

    def generate_turn(self, prompts: list[list[int]], conversations: list[Hashable], params: SamplingParams,
                      generator: torch.Generator) -> list[list[int]]:
        """`generate` for unpadded prompt ids, prompt i continuing conversation `conversations[i]`: with
        reuse_prefix_cache and kept graphs, a call that continues the last call's conversations prefills each
        prompt past what its row's cache holds. Sampled ids per prompt (max_new_tokens each, `pad_id` after the end
        of turn)."""
        check_prompts(prompts)
        if len(set(conversations)) != len(conversations):
            raise ValueError("generate_turn: every prompt of a call must continue a conversation of its own")
        batch = len(prompts)
        lengths = torch.tensor([len(ids) for ids in prompts], device=self.device)
        held = self._held_rows(conversations)
        self._rows_of = {}  # this call overwrites the rows (if it stops halfway, they hold no conversation)
        state = self._call_state(batch, int(lengths.max()) + params.max_new_tokens)
        if held is not None and self._storage is self._cached_in:  # not regrown or dropped (`release`) since
            self._storage.gather_rows(held)  # row i holds conversation i's keys from here on
            offsets = [reusable_length(self._cached[row], ids) for row, ids in zip(held, prompts)]
            prefill = lambda: self._prefill_suffixes(state, list(range(batch)), prompts, offsets)  # noqa: E731
        else:
            prefill = lambda: self._prefill_rows(state, list(range(batch)), prompts)  # noqa: E731
        tokens = self._run(state, prefill, lengths, params, generator, prompts).tolist()
        if self.reuse_prefix_cache and self.keep_graphs:
            self._rows_of = {conversation: row for row, conversation in enumerate(conversations)}
            self._cached = [ids + fed_tokens(sampled, self._stop_set) for ids, sampled in zip(prompts, tokens)]
            self._cached_in = self._storage
        return tokens

    def _held_rows(self, conversations: list[Hashable]) -> list[int] | None:
        """The buffer's rows of these conversations, if reuse is on and every one continues the last call's."""
        if not (self.reuse_prefix_cache and self.keep_graphs and self._storage is self._cached_in):
            return None
        rows = [self._rows_of.get(conversation) for conversation in conversations]
        return None if None in rows else rows

    def _prefill_rows(self, state: _DecodeState, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Prefill `prompts` whole into the cache rows `rows` (positions [0, length)); (len(rows), V) logits of each
        prompt's first new token."""
        width = max(len(ids) for ids in prompts)
        padded = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, ids in enumerate(prompts):
            padded[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths = torch.tensor([len(ids) for ids in prompts], device=self.device)
        cache_rows = torch.tensor(rows, device=self.device)
        if self.attention == SHARED_KERNEL:  # identical prompts prefilled once
            return self._prefill_once(state, padded.to(self.device), lengths, prompts, cache_rows)
        return self._prefill(state, padded.to(self.device), lengths, cache_rows=cache_rows)

    def _prefill_suffixes(self, state: _DecodeState, rows: list[int], prompts: list[list[int]],
                          offsets: list[int]) -> torch.Tensor:
        """Prefill positions [offsets[i], len(prompts[i])) of each prompt into cache row rows[i] (ascending), whose
        keys [0, offsets[i]) hold the prompt's first ids already: the suffixes packed into sequences of at most
        `prefill_chunk_tokens` tokens (at least one suffix), each token at its own position, attending to its row's
        keys up to it (`static_decode.suffix_attention`); (len(rows), V) logits of each prompt's first new token."""
        decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
        logits = []
        counts = [len(ids) - offset for ids, offset in zip(prompts, offsets)]
        for chunk in packed_chunks(counts, self.prefill_chunk_tokens):
            suffix = SuffixPrefill.build([rows[i] for i in chunk], [offsets[i] for i in chunk],
                                         [len(prompts[i]) for i in chunk], state.shape[1], self.device)
            input_ids = torch.tensor([[token for i in chunk for token in prompts[i][offsets[i]:]]], device=self.device)
            state.cache.packed_writes = suffix.writes
            try:
                hidden = decoder(input_ids=input_ids, position_ids=suffix.positions, past_key_values=state.cache,
                                 use_cache=True, **{SUFFIX_KWARG: suffix}).last_hidden_state
            finally:
                state.cache.packed_writes = None
            logits.append(head(hidden[0, suffix.last_tokens]).float())
            self.stats.prefill_tokens += input_ids.shape[1]
        self.stats.reused_tokens += sum(offsets)
        return torch.cat(logits)


def fed_tokens(sampled: list[int], stop_ids: set[int]) -> list[int]:
    """A turn's sampled ids whose keys its row's cache holds as the model computes them: all before the turn's last
    token. That one is an end of turn, fed, if at all, while its row already counted as finished (its attention read
    the row's first key only, so its keys past the first layer are not the model's), or the token at the cap, never
    fed."""
    end = next((i for i, token in enumerate(sampled) if token in stop_ids), len(sampled) - 1)
    return sampled[:end]


def reusable_length(cached: list[int], prompt: list[int]) -> int:
    """How many of the prompt's first ids a row's cache holds (`cached`, its ids): their common prefix, at most all
    but the prompt's last id, whose position gives the first new token's logits, so it is always prefilled."""
    limit = min(len(cached), len(prompt) - 1)
    if cached[:limit] == prompt[:limit]:
        return limit
    return next(i for i in range(limit) if cached[i] != prompt[i])


def packed_chunks(counts: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices of `counts` in groups of at most `limit` summed counts (a larger count alone)."""
    chunks: list[list[int]] = []
    total = 0
    for index, count in enumerate(counts):
        if not chunks or total + count > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(index)
        total += count
    return chunks


def check_prompts(prompts: list[list[int]]) -> None:
    if any(len(ids) == 0 for ids in prompts):
        raise ValueError("a prompt has no token ids: Prompt.prompt_ids must hold the rendered chat")

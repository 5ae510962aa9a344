"""Pipelined turns: each env's next turn starts as soon as its own turn ends, while the other envs decode (issue 42).

A rollout turn-by-turn (LLMAgentProxy's loop) decodes every turn until its *longest* sample ends: on SmolLM2 one
sample in a few hundred runs to the 256-token cap, so each of the 5 turns costs ~255 decode steps of the whole batch
(1,275 a rollout) while the mean sample is ~100 tokens. Here one row of the static decoder serves one env for the
whole rollout: when a row's turn ends (an end-of-turn token, seen at the next check, or its own token cap), the
caller's `respond` steps that env and returns its next prompt, which is prefilled into the row while the other rows
keep decoding. A rollout then costs about as many decode steps as its longest *trajectory*, not the sum of every
turn's longest sample.

Nothing about a sample changes: a row's tokens are drawn from the same model distribution given the same context
(rows are independent; `static_decode`'s module docstring), the same sampling (temperature → top-k → top-p), and
every turn's prompt is the one the turn-by-turn loop would build. Only the random draws are shared out differently
among rows, so a sampled rollout is not token-for-token the turn-by-turn one; a greedy one is (tested).

Mechanics, over `static_decode`'s buffers (one `_DecodeState` of B rows; its CUDA graph captured once):
- a row's tokens go to column `step - start[row]` of its turn's buffer; its position is `prompt_length + column`;
- rows whose turn ended wait, finished (reading one key, as finished rows do), until the next check (every
  CHECK_EVERY steps, or at once when a row reaches its cap, which the host knows without a sync);
- a new prompt is prefilled into its row from position 0 (the whole history, as the turn-by-turn loop does), or
  with `reuse_prefix_cache` from the first position where it departs from what the row's cache holds (below); the
  decode step of that iteration writes its placeholder key at the position the row's first new token will
  overwrite, and the row's next logits are the prefill's;
- a row whose env is done retires (finished for good, position 0);
- when a prompt needs more keys than a row holds, the buffer grows (at least CAPACITY_GROWTH-fold) and its
  contents move over; the decode state (and its graph) is rebuilt.

The reused prefix cache (`reuse_prefix_cache`, prefix_cache.py) prefills a restarted row's next prompt from where it
departs from the ids its cache holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from SPA_agent.generators.base import SamplingParams
from SPA_agent.generators.prefix_cache import PrefixCachedDecoder, check_prompts, fed_tokens, reusable_length
from SPA_agent.generators.static_decode import (
    CAPACITY_GROWTH,
    CHECK_EVERY,
    PROMPT_BUCKET,
    KVStorage,
    _DecodeState,
    decode_attention_mode,
    sample,
)

#: respond(row, sampled ids of the turn that ended (up to the cap, padding after an end of turn)) -> the row's
#: next prompt ids, or None when its env is done
Respond = Callable[[int, list[int]], "list[int] | None"]


class PipelinedDecoder(PrefixCachedDecoder):
    """`serve` runs every env's turns in one decode loop; with `reuse_prefix_cache` a row's next prompt is prefilled
    from where it departs from what the row's cache holds. See the module docstring."""

    def serve(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator,
              respond: Respond) -> None:
        """Decode the first turn of every row's prompt, hand each ended turn to `respond`, continue each row with the
        prompt it returns, until `respond` has returned None for every row."""
        check_prompts(prompts)
        batch, new_tokens, device = len(prompts), params.max_new_tokens, self.device
        tokens = torch.full((batch, new_tokens), self.pad_id, dtype=torch.long, device=device)  # each row's turn
        lengths = torch.tensor([len(ids) for ids in prompts], device=device)  # of each row's current prompt
        start_steps = torch.zeros(batch, dtype=torch.long, device=device)  # the step each row's turn began at
        waiting = torch.zeros(batch, dtype=torch.bool, device=device)  # turn ended (or row retired), not handed on
        retired = torch.zeros(batch, dtype=torch.bool, device=device)
        starts = [0] * batch  # start_steps on the host; -1 once retired
        cached = list(prompts)  # per row, the ids whose keys its cache holds as the model computes them
        capped_at = {new_tokens - 1: set(range(batch))}  # step -> rows whose turn reached its cap there (if it ran)
        live = batch
        rows = torch.arange(batch, device=device)
        with decode_attention_mode(self.model):
            state = self._grown(None, batch, int(lengths.max()) + new_tokens)
            logits = self._prefill_rows(state, list(range(batch)), prompts)
            step = 0
            while True:
                next_tokens = sample(logits, params, generator).masked_fill(waiting, self.pad_id)
                tokens[rows, (step - start_steps).clamp(max=new_tokens - 1)] = next_tokens
                waiting |= torch.isin(next_tokens, self.stop_ids)
                capped = {row for row in capped_at.pop(step, ()) if starts[row] == step - new_tokens + 1}
                restarted: list[int] = []
                if capped or step % CHECK_EVERY == CHECK_EVERY - 1:
                    ended = sorted(capped | {row for row, w in enumerate(waiting.logical_and(~retired).tolist()) if w})
                    state, restarted, next_prompts, first_logits = self._hand_on(state, ended, tokens, respond,
                                                                                 cached)
                    finished_now = sorted(set(ended) - set(restarted))
                    retired[finished_now] = True
                    for row in finished_now:
                        starts[row] = -1
                    live -= len(finished_now)
                    if live == 0:
                        break
                    waiting.copy_(retired)
                    for row in restarted:
                        starts[row] = step + 1
                        capped_at.setdefault(step + new_tokens, set()).add(row)
                    if restarted:
                        lengths[restarted] = torch.tensor([len(ids) for ids in next_prompts], device=device)
                        start_steps[restarted] = step + 1
                        tokens[restarted] = self.pad_id
                # Feed the sampled tokens. A restarted row feeds a placeholder at the position of its first new
                # token, which that token's own step overwrites; its next logits are its prefill's.
                positions = (lengths + (step - start_steps)).masked_fill(retired, 0)
                finished = waiting.clone()
                if restarted:
                    positions[restarted] = lengths[restarted]
                    finished[restarted] = True
                state.input_ids[:, 0].copy_(next_tokens)
                state.positions.copy_(positions)
                state.finished.copy_(finished)
                logits = state.step()
                self.stats.decode_steps += 1
                if restarted:
                    logits = logits.index_put((torch.tensor(restarted, device=device),), first_logits)
                step += 1

    def _hand_on(self, state: _DecodeState, ended: list[int], tokens: torch.Tensor, respond: Respond,
                 cached: list[list[int]]) -> tuple[_DecodeState, list[int], list[list[int]], torch.Tensor | None]:
        """`respond` for each row whose turn ended; the rows it continues are prefilled with their new prompts.
        Returns the (possibly grown) state, those rows, their prompts and their first-token logits. `cached` (per
        row, the ids its cache holds) gains each ended turn's fed tokens, then the restarted rows' prompts."""
        restarted, next_prompts = [], []
        for row, ids in zip(ended, tokens[ended].tolist()):
            cached[row] = cached[row] + fed_tokens(ids, self._stop_set)
            prompt = respond(row, ids)
            if prompt is not None:
                restarted.append(row)
                next_prompts.append(prompt)
        if not restarted:
            return state, restarted, next_prompts, None
        check_prompts(next_prompts)
        needed = max(len(ids) for ids in next_prompts) + tokens.shape[1]
        if needed > state.shape[1]:
            state = self._grown(state, state.shape[0], needed)
        return state, restarted, next_prompts, self._prefill_next(state, restarted, next_prompts, cached)

    def _prefill_next(self, state: _DecodeState, rows: list[int], prompts: list[list[int]],
                      cached: list[list[int]]) -> torch.Tensor:
        """Prefill each row's next prompt: whole, or with reuse_prefix_cache past its common prefix with what the
        row's cache holds; (len(rows), V) first-token logits. The rows' cached ids become their prompts."""
        if self.reuse_prefix_cache:
            offsets = [reusable_length(cached[row], ids) for row, ids in zip(rows, prompts)]
            logits = self._prefill_suffixes(state, rows, prompts, offsets)
        else:
            logits = self._prefill_rows(state, rows, prompts)
        for row, ids in zip(rows, prompts):
            cached[row] = ids
        return logits

    def _grown(self, state: _DecodeState | None, batch: int, max_len: int) -> _DecodeState:
        """A decode state of `batch` rows of at least `max_len` keys: a new one, or in place of `state` one over a
        grown buffer (at least CAPACITY_GROWTH-fold, the old keys and values copied over), its graph captured."""
        if self.use_cuda_graphs:
            max_len += -max_len % PROMPT_BUCKET
        old = self._storage if state is not None else None
        if old is not None:
            max_len = max(max_len, CAPACITY_GROWTH * old.max_len)
        self.release()
        self._storage = storage = KVStorage(batch, max_len)
        fresh = _DecodeState(self.model, batch, storage, self.use_cuda_graphs, self._step_fn, self.attention)
        self._states[batch] = fresh
        self.stats.states_built += 1
        fresh.capture()  # writes placeholder keys, so before the old ones are copied in
        self.stats.capture_s += fresh.capture_s
        if old is not None:
            for layer, (keys, values) in enumerate(zip(old.keys, old.values)):
                new_keys, new_values = storage.layer(layer, keys[:1].transpose(1, 2), values[:1].transpose(1, 2),
                                                     batch)
                new_keys[:, : old.max_len].copy_(keys)
                new_values[:, : old.max_len].copy_(values)
        return fresh

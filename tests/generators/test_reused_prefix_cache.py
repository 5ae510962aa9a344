"""generator.reuse_prefix_cache (prefix_cache.py): a turn's prompt is prefilled from where it departs from what its
row's cache holds (its last prompt and the tokens it fed), attending to the row's cached keys
(static_decode.suffix_attention), in pipelined turns (turn_pipeline.py) and turn by turn (one call a turn, kept
decode graphs). On CPU in float32: the first-token logits of a whole prefill, the greedy turns of
the decoder without reuse, the prefill and reused tokens counted; prompts that do not extend the history reuse
nothing or only up to where they differ. On a GPU: flash attention's kernel against the masked one."""

from __future__ import annotations

import copy

import pytest
import torch
from test_turn_pipeline import GREEDY, TURNS, ToyEnvs, turn_by_turn  # the pipelined decoder's toy envs

from SPA_agent.generators import static_decode
from SPA_agent.generators.hf import end_of_turn_ids, left_pad, pad_token_id
from SPA_agent.generators.prefix_cache import PrefixCachedDecoder, fed_tokens, reusable_length
from SPA_agent.generators.static_decode import SuffixPrefill, decode_attention_mode, masked_suffix
from SPA_agent.generators.turn_pipeline import PipelinedDecoder


class RecordedEnvs(ToyEnvs):
    """ToyEnvs whose rows' every prompt is kept (`given`: row -> prompts in order), and whose next prompt is made
    from the one ToyEnvs builds by `edit(row, turn, prompt)` (default: unchanged, so it extends the history).
    `first_prefill`: the decoder's prefill tokens at the first hand-on (`stats`, its DecodeStats), those of the
    first prompts."""

    def __init__(self, tokenizer, stop_ids: list[int], edit=lambda row, turn, prompt: prompt):
        super().__init__(tokenizer, stop_ids)
        self.edit = edit
        self.given = [[list(ids)] for ids in self.prompts]
        self.stats, self.first_prefill = None, None

    def respond(self, row: int, sampled: list[int]) -> list[int] | None:
        if self.first_prefill is None:
            self.first_prefill = self.stats.prefill_tokens
        prompt = super().respond(row, sampled)
        if prompt is None:
            return None
        self.prompts[row] = self.edit(row, len(self.turns[row]), prompt)
        self.given[row].append(self.prompts[row])
        return self.prompts[row]


def served(model, tokenizer, reuse: bool, edit=None, params=GREEDY) -> tuple[RecordedEnvs, PipelinedDecoder]:
    """A pipelined rollout of the toy envs, with or without the reused prefix cache."""
    stop_ids = end_of_turn_ids(model, tokenizer)
    envs = RecordedEnvs(tokenizer, stop_ids, **({"edit": edit} if edit else {}))
    decoder = PipelinedDecoder(model, stop_ids, pad_token_id(tokenizer, stop_ids), reuse_prefix_cache=reuse)
    envs.stats = decoder.stats
    with torch.inference_mode():
        decoder.serve(list(envs.prompts), params, torch.Generator().manual_seed(0), envs.respond)
    return envs, decoder


def expected_reuse(envs: RecordedEnvs, stop_ids: set[int]) -> list[int]:
    """Per hand-on of each row, the prompt ids the cache holds: the common prefix of the next prompt with the last
    prompt and the turn's fed tokens."""
    return [reusable_length(given[turn] + fed_tokens(ids, stop_ids), given[turn + 1])
            for given, turns in zip(envs.given, envs.turns) for turn, (ids, _) in enumerate(turns[:-1])]


def test_greedy_turns_with_the_reused_cache_are_those_of_the_whole_prefill(varied_model, tiny_tokenizer, monkeypatch):
    """Every row's every turn has the tokens and finish reason of the decoder that prefills each prompt whole,
    with turns that stop and turns cut at the cap, a buffer that grows (its reused keys copied over), and suffixes
    packed a few to a forward. The cache holds each prompt and the turn's tokens but the last, so each next prompt
    reuses exactly that much; the prefill runs only the rest, several times fewer tokens."""
    stop_ids = set(end_of_turn_ids(varied_model, tiny_tokenizer))
    whole, _ = served(varied_model, tiny_tokenizer, reuse=False)
    monkeypatch.setattr(static_decode, "PREFILL_TOKENS", 40)  # a few suffixes a packed forward, some alone
    reused, decoder = served(varied_model, tiny_tokenizer, reuse=True)
    assert reused.turns == whole.turns and [len(turns) for turns in reused.turns] == TURNS
    assert {reason for turns in reused.turns for _, reason in turns} == {"stop", "length"}
    assert decoder.stats.states_built >= 2
    reuse = expected_reuse(reused, stop_ids)
    assert reuse == [len(given[turn]) + len(ids) - 1 for given, turns in zip(reused.given, reused.turns)
                     for turn, (ids, _) in enumerate(turns[:-1])]  # the last prompt and all but the turn's last token
    assert decoder.stats.reused_tokens == sum(reuse) > 0
    next_prompts = sum(len(ids) for given in reused.given for ids in given[1:])
    suffixes = decoder.stats.prefill_tokens - reused.first_prefill  # what the hand-ons prefilled
    assert suffixes == next_prompts - sum(reuse) and 3 * suffixes < next_prompts


def test_a_prompt_that_does_not_start_with_the_history_is_prefilled_whole(varied_model, tiny_tokenizer):
    """A next prompt whose first id differs from the row's (p = 0) reuses nothing and decodes as without reuse."""
    fresh = lambda row, turn, prompt: tiny_tokenizer.encode(f"{turn} fresh {row}:") + prompt[-5:]  # from "1 fresh"
    whole, _ = served(varied_model, tiny_tokenizer, reuse=False, edit=fresh)
    reused, decoder = served(varied_model, tiny_tokenizer, reuse=True, edit=fresh)
    assert all(given[turn][0] != given[turn + 1][0] for given in reused.given for turn in range(len(given) - 1))
    assert reused.turns == whole.turns and decoder.stats.reused_tokens == 0


def test_a_prompt_that_departs_from_the_history_reuses_up_to_where_it_departs(varied_model, tiny_tokenizer):
    """A next prompt with one id changed inside the history (as if an earlier turn were re-rendered) reuses the
    ids before it, prefills from it, and decodes as without reuse."""
    def changed(row, turn, prompt):
        at = 3 + row  # inside the first prompt
        return [*prompt[:at], prompt[at] + 1, *prompt[at + 1:]]

    whole, _ = served(varied_model, tiny_tokenizer, reuse=False, edit=changed)
    reused, decoder = served(varied_model, tiny_tokenizer, reuse=True, edit=changed)
    assert reused.turns == whole.turns
    assert expected_reuse(reused, set(end_of_turn_ids(varied_model, tiny_tokenizer))) == [
        3 + row for row, turns in enumerate(reused.turns) for _ in turns[:-1]]
    assert decoder.stats.reused_tokens == sum((3 + row) * (TURNS[row] - 1) for row in range(len(TURNS)))


@pytest.mark.slow
def test_an_spa_rollout_with_the_reused_cache_is_the_rollout_without(varied_model, tiny_tokenizer, tiny_config):
    """LLMAgentProxy with pipelined turns, greedy, 3 turns of SPA's add_worldmodel prompts: with the reused cache,
    the same rollout (every turn, the training batch's tensors), and the prompts' histories come from the cache:
    fewer than half the prefill tokens (8.6k against 22.1k when written)."""
    from SPA_agent.generators.hf import HFGenerator
    from SPA_agent.rollout.agent_proxy import LLMAgentProxy

    rollouts, stats = [], []
    for reuse in (False, True):
        cfg = tiny_config("_2_sokoban", "ctx_manager.mode=add_worldmodel", "agent_proxy.max_turn=3",
                          "agent_proxy.pipeline_turns=true")
        generator = HFGenerator(varied_model, tiny_tokenizer, GREEDY, batch_size=None, decoder="static",
                                progress=False, decode_attention="flash", reuse_prefix_cache=reuse)
        with torch.inference_mode():
            rollouts.append(LLMAgentProxy(cfg, generator, tiny_tokenizer).rollout(val=False))
        stats.append(generator._static.stats)
    whole, reused = rollouts
    assert [s.history for s in reused.states] == [s.history for s in whole.states]
    for key, tensor in whole.batch.batch.items():
        assert torch.equal(reused.batch.batch[key], tensor), key
    assert stats[1].reused_tokens > 0 and 2 * stats[1].prefill_tokens < stats[0].prefill_tokens


def by_call(model, tokenizer, reuse: bool, keep_graphs: bool = True, edit=None) -> tuple[RecordedEnvs, PrefixCachedDecoder]:
    """The toy envs turn by turn, one `generate_turn` call a turn over the rows still running, in the last call's
    order reversed (so a call's rows are a subset of the last call's, in another order), each row its own
    conversation."""
    stop_ids = end_of_turn_ids(model, tokenizer)
    envs = RecordedEnvs(tokenizer, stop_ids, **({"edit": edit} if edit else {}))
    decoder = PrefixCachedDecoder(model, stop_ids, pad_token_id(tokenizer, stop_ids), keep_graphs=keep_graphs,
                                  reuse_prefix_cache=reuse)
    envs.stats, envs.reused = decoder.stats, []  # per call: the prompt tokens it reused
    running, generator = list(range(len(TURNS))), torch.Generator().manual_seed(0)
    with torch.inference_mode():
        while running:
            running.reverse()
            reused_before = decoder.stats.reused_tokens
            sampled = decoder.generate_turn([envs.prompts[row] for row in running], running, GREEDY, generator)
            envs.reused.append(decoder.stats.reused_tokens - reused_before)
            running = [row for row, ids in zip(running, sampled) if envs.respond(row, ids) is not None]
    return envs, decoder


def test_turn_by_turn_calls_with_the_reused_cache_decode_as_whole_prefills(varied_model, tiny_tokenizer, monkeypatch):
    """One call a turn: every row's every turn has the tokens of the decoder that prefills each prompt whole
    (test_turn_pipeline's turn-by-turn loop), while rows drop out and change places between calls (their keys
    gathered to the front), the buffer grows (that call prefills whole) and suffixes pack a few to a forward.
    Without kept graphs (no buffer outlives a call) nothing is reused."""
    stop_ids = set(end_of_turn_ids(varied_model, tiny_tokenizer))
    with torch.inference_mode():
        whole, _ = turn_by_turn(varied_model, tiny_tokenizer, GREEDY)
    gathered, real_gather = [], static_decode.KVStorage.gather_rows
    monkeypatch.setattr(static_decode.KVStorage, "gather_rows",
                        lambda storage, rows: gathered.append(rows) or real_gather(storage, rows))
    monkeypatch.setattr(static_decode, "PREFILL_TOKENS", 40)
    reused, decoder = by_call(varied_model, tiny_tokenizer, reuse=True)
    assert reused.turns == whole.turns and [len(turns) for turns in reused.turns] == TURNS
    assert any(rows != sorted(rows) for rows in gathered) and any(len(rows) < len(TURNS) for rows in gathered)
    # per call after the first, what the rows' caches hold of their next prompts: the last prompt and the turn's
    # tokens but the last; all of it, or nothing where the call grew the buffer (one call here)
    expected = [sum(reusable_length(reused.given[row][turn] + fed_tokens(reused.turns[row][turn][0], stop_ids),
                                    reused.given[row][turn + 1]) for row in range(len(TURNS)) if TURNS[row] > turn + 1)
                for turn in range(max(TURNS) - 1)]
    assert decoder.stats.states_built == 2 and reused.reused[0] == 0
    grown = [call for call, (got, want) in enumerate(zip(reused.reused[1:], expected)) if got != want]
    assert len(grown) == 1 and reused.reused[1 + grown[0]] == 0 and sum(expected) > 0
    unkept, decoder = by_call(varied_model, tiny_tokenizer, reuse=True, keep_graphs=False)
    assert unkept.turns == whole.turns and decoder.stats.reused_tokens == 0


def test_no_old_kv_buffer_is_alive_when_a_regrown_one_is_allocated(varied_model, tiny_tokenizer, monkeypatch):
    """The buffer grows (a new KVStorage, the old one dropped) while the cache's bookkeeping names the old one: it
    must not keep it alive, or a growing call holds both buffers at once (tens of GB at SPA's batch)."""
    import gc
    import weakref

    buffers = []

    class Recorded(static_decode.KVStorage):
        def __init__(self, *args):
            gc.collect()
            assert all(buffer() is None for buffer in buffers), "an old KV buffer is still referenced"
            super().__init__(*args)
            buffers.append(weakref.ref(self))

    monkeypatch.setattr(static_decode, "KVStorage", Recorded)
    envs, decoder = by_call(varied_model, tiny_tokenizer, reuse=True)
    assert len(buffers) >= 2 and decoder.stats.reused_tokens > 0  # it grew, and reused where it did not


def test_a_call_that_does_not_continue_the_last_calls_chats_prefills_whole(varied_model, tiny_tokenizer):
    """generate_turn reuses rows only for a call whose every chat the last call left in the buffer: one new chat
    (a new rollout names new ones), or a `generate` call in between, and the call prefills whole."""
    stop_ids = end_of_turn_ids(varied_model, tiny_tokenizer)
    decoder = PrefixCachedDecoder(varied_model, stop_ids, pad_token_id(tiny_tokenizer, stop_ids), keep_graphs=True,
                                  reuse_prefix_cache=True)
    first = [tiny_tokenizer.encode(f"chat {c}: the room is #_P") for c in range(3)]
    with torch.inference_mode():
        sampled = decoder.generate_turn(first, ["a", "b", "c"], GREEDY, torch.Generator().manual_seed(0))
        second = [ids + fed_tokens(turn, set(stop_ids)) + [5, 6] for ids, turn in zip(first, sampled)]
        decoder.generate_turn(second[:2], ["a", "new"], GREEDY, torch.Generator())
        assert decoder.stats.reused_tokens == 0
        decoder.generate_turn(second[:1], ["a"], GREEDY, torch.Generator())
        assert decoder.stats.reused_tokens == len(second[0]) - 1  # "a" was in the last call: all but the last id
        decoder.generate(*left_pad([second[0] + [7]], 0, decoder.device), GREEDY, torch.Generator())
        decoder.generate_turn([second[0] + [7, 8]], ["a"], GREEDY, torch.Generator())
        assert decoder.stats.reused_tokens == len(second[0]) - 1
        with pytest.raises(ValueError, match="a conversation of its own"):
            decoder.generate_turn(second[:2], ["a", "a"], GREEDY, torch.Generator())


@pytest.mark.slow
def test_an_spa_rollout_turn_by_turn_with_the_reused_cache_is_the_rollout_without(varied_model, tiny_tokenizer,
                                                                                  tiny_config):
    """LLMAgentProxy turn by turn with kept decode graphs, greedy, two rollouts of 3 turns of SPA's add_worldmodel
    prompts: with the reused cache, the same rollouts (every turn, the training batches' tensors); each rollout's
    first turn prefills whole (its chats are new), the later turns only their new tokens (where the buffer did not
    grow)."""
    from SPA_agent.generators.hf import HFGenerator
    from SPA_agent.rollout.agent_proxy import LLMAgentProxy

    rollouts, stats = [], []
    for reuse in (False, True):
        cfg = tiny_config("_2_sokoban", "ctx_manager.mode=add_worldmodel", "agent_proxy.max_turn=3")
        generator = HFGenerator(varied_model, tiny_tokenizer, GREEDY, batch_size=None, decoder="static",
                                progress=False, decode_attention="flash", keep_decode_graphs=True,
                                reuse_prefix_cache=reuse)
        proxy = LLMAgentProxy(cfg, generator, tiny_tokenizer)
        with torch.inference_mode():
            rollouts.append([proxy.rollout(val=False) for _ in range(2)])
        stats.append(generator._static.stats)
    for whole, reused in zip(*rollouts):
        assert [s.history for s in reused.states] == [s.history for s in whole.states]
        for key, tensor in whole.batch.batch.items():
            assert torch.equal(reused.batch.batch[key], tensor), key
    assert stats[1].reused_tokens > 0 and stats[1].prefill_tokens + stats[1].reused_tokens <= stats[0].prefill_tokens
    assert 5 * stats[1].prefill_tokens < 3 * stats[0].prefill_tokens  # 23.2k against 44.3k when written


def test_reusable_length_is_the_common_prefix_less_the_prompts_last_id():
    assert reusable_length([1, 2, 3, 4], [1, 2, 3, 4, 5, 6]) == 4  # the whole cache
    assert reusable_length([1, 2, 3, 4], [1, 2, 9, 4, 5]) == 2  # up to the first differing id
    assert reusable_length([1, 2, 3, 4], [1, 2, 3]) == 2  # the prompt's last id is always prefilled
    assert reusable_length([1, 2], [7, 2, 3]) == 0
    assert fed_tokens([5, 6, 2, 0, 0], {2}) == [5, 6]  # before the end of turn
    assert fed_tokens([5, 6, 7], {2}) == [5, 6]  # at the cap: the last token was never fed


def first_token_logits(model, prompts: list[list[int]], rows: list[int], offsets: list[int] | None
                       ) -> torch.Tensor:
    """Logits of each prompt's first new token from a decoder of 4 rows: prefilled whole into `rows`, or (offsets
    given) its first offsets[i] ids prefilled whole first, then the rest as a suffix prefill."""
    decoder = PipelinedDecoder(model, [0], 0, reuse_prefix_cache=True)
    with torch.inference_mode(), decode_attention_mode(model):
        state = decoder._grown(None, 4, max(len(ids) for ids in prompts) + 4)
        if offsets is None:
            return decoder._prefill_rows(state, rows, prompts)
        decoder._prefill_rows(state, rows, [ids[: max(offset, 1)] for ids, offset in zip(prompts, offsets)])
        return decoder._prefill_suffixes(state, rows, prompts, offsets)


def test_suffix_prefill_gives_the_first_token_logits_of_a_whole_prefill(varied_model):
    """Rows whose caches hold 0, a few or all but one of their prompt's ids: the suffix prefill's logits are the
    whole prefill's, within float32 rounding: 1e-5 of the logits' scale (up to 10.7 here; through the suffix kernel,
    a whole prompt's logits differ by 1.4e-5, keys read wrong cost whole logits)."""
    prompts = [list(range(5, 5 + n)) for n in (30, 9, 17)]
    rows, offsets = [0, 2, 3], [29, 0, 6]
    whole = first_token_logits(varied_model, prompts, rows, None)
    suffix = first_token_logits(varied_model, prompts, rows, offsets)
    torch.testing.assert_close(suffix, whole, atol=1e-5 * float(whole.abs().max()), rtol=0)


def suffix_inputs(device="cpu", dtype=torch.float32, offsets=(0, 5, 37), ends=(12, 6, 70), rows=(0, 2, 3)):
    """Random packed queries (1, 6, T, D) of suffixes [offsets[i], ends[i]) of cache rows `rows`, a cache
    (4, 80, 2, D) of keys and values, and their SuffixPrefill."""
    gen = torch.Generator().manual_seed(0)
    total = sum(end - offset for offset, end in zip(offsets, ends))
    query = torch.randn(1, 6, total, 64, generator=gen)
    key, value = (torch.randn(4, 80, 2, 64, generator=gen) for _ in range(2))
    suffix = SuffixPrefill.build(list(rows), list(offsets), list(ends), 80, torch.device(device))
    to = dict(device=device, dtype=dtype)
    return query.to(**to), key.to(**to), value.to(**to), suffix


def reference_suffix(query, key, value, suffix) -> torch.Tensor:
    """Each row's whole causal attention over its first ends[i] positions (queries at the suffix's positions from
    `query`), its suffix's outputs kept; float32, (1, T, H, D)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    outputs, start = [], 0
    for row, offset, end in zip(suffix.rows, suffix.offsets, suffix.ends):
        queries = torch.zeros(1, query.shape[1], end, query.shape[3], device=query.device)
        queries[:, :, offset:] = query[:, :, start : start + end - offset].float()
        keys, values = (repeat_kv(t[row : row + 1, :end].transpose(1, 2).float(), 3) for t in (key, value))
        output = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=0.125)
        outputs.append(output[0, :, offset:].transpose(0, 1))
        start += end - offset
    return torch.cat(outputs)[None]


def test_masked_suffix_attention_reads_each_rows_keys_up_to_each_query():
    query, key, value, suffix = suffix_inputs()
    output = masked_suffix(query, key, value, suffix, scaling=0.125)
    torch.testing.assert_close(output, reference_suffix(query, key, value, suffix))
    key[:, 70:], value[:, 70:] = 1e4, -1e4  # keys past every suffix's end are never read
    torch.testing.assert_close(masked_suffix(query, key, value, suffix, scaling=0.125), output)


def test_reuse_prefix_cache_setting_is_read_and_checked(varied_model, tiny_tokenizer):
    from SPA_agent.config import compose
    from SPA_agent.generators.hf import HFGenerator
    from SPA_agent.trainer.config_checks import check_config

    cfg = {"decoder": "static", "progress": False, "reuse_prefix_cache": True}
    generator = HFGenerator.from_config(cfg, "tiny", tiny_tokenizer, model=varied_model)
    assert generator._static_decoder().reuse_prefix_cache
    assert compose("_2_sokoban", ["model=tiny"]).generator.reuse_prefix_cache is False  # off by default
    check_config(compose("_2_sokoban", ["model=tiny", "generator.reuse_prefix_cache=true", "agent_proxy.pipeline_turns=true"]))
    check_config(compose("_2_sokoban", ["model=tiny", "generator.reuse_prefix_cache=true",
                                        "actor_rollout_ref.rollout.keep_decode_graphs=true"]))  # turn by turn
    with pytest.raises(ValueError, match=r"generator.reuse_prefix_cache must be one of \(True, False\), got 'yes'"):
        check_config(compose("_2_sokoban", ["model=tiny", "generator.reuse_prefix_cache=yes"]))
    with pytest.raises(ValueError, match=r"^generator.reuse_prefix_cache=true turn by turn keeps each chat's keys in "
                                         r"the kept KV buffer: add actor_rollout_ref.rollout.keep_decode_graphs=true"):
        check_config(compose("_2_sokoban", ["model=tiny", "generator.reuse_prefix_cache=true"]))  # nothing to keep


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's kernel needs a CUDA GPU")
def test_suffix_prefill_on_a_gpu(varied_model, tiny_tokenizer, monkeypatch):
    """On a GPU: flash attention's variable-length kernel (bottom-right causal, keys read in the cache's rows) gives
    the masked attention in bfloat16, for suffixes of several tokens and of one each; the reusing pipelined decoder
    gives the greedy turns of the whole prefill in float32 (masked SDPA), and in float16 (flash attention's suffix
    prefill) runs every row's turns to their end; so does the decoder of one call a turn over kept CUDA graphs."""
    if not static_decode._flash_capable(torch.device("cuda")):
        pytest.skip("flash attention needs an Ampere or newer GPU")
    for offsets in ((0, 5, 37), (11, 5, 69)):  # the second: one query a suffix
        query, key, value, suffix = suffix_inputs("cuda", torch.bfloat16, offsets=offsets)
        output = static_decode.suffix_attention(query, key, value, suffix, scaling=0.125)
        torch.testing.assert_close(output.float(), reference_suffix(query, key, value, suffix), atol=2e-2, rtol=0)
    model = copy.deepcopy(varied_model).to("cuda", torch.float32)
    whole, _ = served(model, tiny_tokenizer, reuse=False)
    reused, decoder = served(model, tiny_tokenizer, reuse=True)
    assert reused.turns == whole.turns and decoder.stats.reused_tokens > 0
    flash_calls, real_flash = [], static_decode.flash_suffix
    monkeypatch.setattr(static_decode, "flash_suffix", lambda *a, **k: flash_calls.append(1) or real_flash(*a, **k))
    half = copy.deepcopy(varied_model).to("cuda", torch.float16)
    reused, decoder = served(half, tiny_tokenizer, reuse=True)
    assert flash_calls and [len(turns) for turns in reused.turns] == TURNS and decoder.stats.reused_tokens > 0
    assert all(0 < len(ids) <= GREEDY.max_new_tokens for turns in reused.turns for ids, _ in turns)
    # turn by turn, one call a turn, over kept CUDA graphs: float32 as the whole prefill, float16 to the end
    with torch.inference_mode():
        whole, _ = turn_by_turn(model, tiny_tokenizer, GREEDY)
    reused, decoder = by_call(model, tiny_tokenizer, reuse=True)
    assert reused.turns == whole.turns and decoder.stats.reused_tokens > 0
    reused, decoder = by_call(half, tiny_tokenizer, reuse=True)
    assert [len(turns) for turns in reused.turns] == TURNS and decoder.stats.reused_tokens > 0

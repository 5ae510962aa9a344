"""generator.compact_decode_rows (static_decode.py, `compact_rows`): once few of a call's rows still run, they decode
alone in a small decode state, their keys copied in and back.

On CPU in float32: sampled and greedy calls give token for token the samples of the decoder without compaction
(every random draw is still made on all rows' logits), with and without kept decode graphs; turn by turn with the
reused prefix cache the same turns, and the same reuse (the compacted rows' keys are back in their rows; a decoder
that skips the copy back decodes other turns, so the test can fail); with split_kv_shared the compact state attends
with split_kv. On a GPU (`gpu` below): calls and turns as on CPU, with CUDA graphs."""

from __future__ import annotations

import copy

import pytest
import torch
from test_reused_prefix_cache import RecordedEnvs
from test_shared_prefix_decode import decoder as shared_decoder
from test_shared_prefix_decode import grouped_ids, leader_reads  # noqa: F401 (a fixture)
from test_static_decode import hf, ids
from test_turn_pipeline import GREEDY, TURNS

from SPA_agent.generators import SamplingParams, split_kv_decode, static_decode
from SPA_agent.generators.hf import end_of_turn_ids, left_pad, pad_token_id
from SPA_agent.generators.prefix_cache import PrefixCachedDecoder
from SPA_agent.generators.static_decode import DONE_LAG, DoneWatch, masked_decode

#: prompts of a call (`ending_model`: most rows end their turn early, a few run to the cap)
LENGTHS = [1, 12, 3, 40, 7, 20, 2, 30, 5, 9, 15, 4]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=32, seed=3)
#: ids the varied model samples often, at various steps: with them as ends of turn, most of a call's rows end early
ENDS = [674, 266, 97, 630, 786]


@pytest.fixture(scope="module")
def ending_model(varied_model, tiny_tokenizer):
    """The varied model whose turns also end at ENDS: its samples end at steps 1 to 30 of 32, a few at the cap (the
    varied model's own run to the cap in most rows, so too few rows would be left running to compact)."""
    model = copy.deepcopy(varied_model)
    model.generation_config.eos_token_id = [*end_of_turn_ids(varied_model, tiny_tokenizer), *ENDS]
    return model


def compacted(model, tokenizer, sampling, compact_rows: int, **settings):
    return hf(model, tokenizer, sampling, "static", batch_size=None, compact_decode_rows=compact_rows, **settings)


@pytest.mark.parametrize("keep_graphs", [False, True], ids=["own_state", "kept_states"])
@pytest.mark.parametrize("compact_rows", [2, 4])
def test_compacted_calls_sample_what_the_full_batch_samples(ending_model, tiny_tokenizer, prompts_of_lengths,
                                                            keep_graphs, compact_rows):
    """Sampled (temperature, top-p) and greedy calls, one after another: the tokens of the decoder without
    compaction, though the last rows decoded apart (the random stream does not depend on the logits' values: the
    sampler draws for every row each step); one compact state built and kept as the call's are."""
    full = compacted(ending_model, tiny_tokenizer, SAMPLED, 0, keep_decode_graphs=keep_graphs)
    compact = compacted(ending_model, tiny_tokenizer, SAMPLED, compact_rows, keep_decode_graphs=keep_graphs)
    compacted_steps = []  # after the sampled calls, after the greedy ones
    for sampling in (SAMPLED, SamplingParams(temperature=0.0, max_new_tokens=32)):
        full.sampling = compact.sampling = sampling
        for lengths in (LENGTHS, LENGTHS[:7]):
            prompts = prompts_of_lengths(lengths)
            assert ids(compact.generate(prompts)) == ids(full.generate(prompts))
        compacted_steps.append(compact._static.stats.compact_steps)
    stats, full_stats = compact._static.stats, full._static.stats
    assert 0 < compacted_steps[0] < compacted_steps[1] < stats.decode_steps == full_stats.decode_steps
    assert full_stats.compact_steps == stats.compact_graph_steps == 0  # (no CUDA graphs on CPU)
    built = stats.states_built - full_stats.states_built  # the compact state: kept, or built by each call using it
    assert built == 1 if keep_graphs else built >= 1


def test_a_batch_no_larger_than_the_compact_state_is_never_compacted(ending_model, tiny_tokenizer,
                                                                     prompts_of_lengths):
    compact = compacted(ending_model, tiny_tokenizer, SAMPLED, 4)
    compact.generate(prompts_of_lengths(LENGTHS[:4]))
    assert compact._static.stats.compact_steps == 0 and compact._static._compact is None


def by_call(model, tokenizer, params: SamplingParams, compact_rows: int) -> tuple[RecordedEnvs, PrefixCachedDecoder]:
    """The toy envs turn by turn (test_reused_prefix_cache's `by_call`), kept graphs and the reused prefix cache:
    one `generate_turn` call a turn over the rows still running, in the last call's order reversed."""
    stop_ids = end_of_turn_ids(model, tokenizer)
    envs = RecordedEnvs(tokenizer, stop_ids)
    decoder = PrefixCachedDecoder(model, stop_ids, pad_token_id(tokenizer, stop_ids), keep_graphs=True,
                                  reuse_prefix_cache=True, compact_rows=compact_rows)
    envs.stats = decoder.stats
    running, generator = list(range(len(TURNS))), torch.Generator().manual_seed(0)
    with torch.inference_mode():
        while running:
            running.reverse()
            sampled = decoder.generate_turn([envs.prompts[row] for row in running], running, params, generator)
            running = [row for row, ids in zip(running, sampled) if envs.respond(row, ids) is not None]
    return envs, decoder


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.6, max_new_tokens=24)],
                         ids=["greedy", "sampled"])
def test_turns_with_the_reused_prefix_cache_are_those_without_compaction(ending_model, tiny_tokenizer, params):
    """Turn by turn over the kept buffer, each turn prefilled past what its row holds: the same turns and the same
    reused tokens as without compaction, so each compacted row's keys were back in its row for the next turn."""
    full, full_decoder = by_call(ending_model, tiny_tokenizer, params, compact_rows=0)
    compact, decoder = by_call(ending_model, tiny_tokenizer, params, compact_rows=3)
    assert compact.turns == full.turns and [len(turns) for turns in compact.turns] == TURNS
    assert decoder.stats.compact_steps > 0 and decoder.stats.reused_tokens == full_decoder.stats.reused_tokens > 0


def test_turns_without_the_keys_put_back_differ(ending_model, tiny_tokenizer, monkeypatch):
    """The test above can fail: if the compacted rows' new keys stayed in the compact state, the next turns would
    read the keys the full batch wrote there before the switch, and decode other tokens."""
    full, _ = by_call(ending_model, tiny_tokenizer, GREEDY, compact_rows=0)
    monkeypatch.setattr(static_decode._CompactRows, "put_back", lambda self: None)
    compact, decoder = by_call(ending_model, tiny_tokenizer, GREEDY, compact_rows=2)
    assert decoder.stats.compact_steps > 0 and compact.turns != full.turns


def test_the_compact_state_of_a_shared_prefix_decoder_attends_with_split_kv(ending_model, tiny_tokenizer, make_prompt,
                                                                            leader_reads, monkeypatch):  # noqa: F811
    """With split_kv_shared (its kernel's contract in torch, `leader_reads`) the compact state's rows share no known
    prefix: it attends with split_kv (here the masked attention, its contract), and the greedy tokens are the
    masked attention's without compaction."""
    kernels = []

    def split_kv(query, key, value, kv_lengths, scaling=None):
        kernels.append(query.shape[0])
        return masked_decode(query, key, value, kv_lengths, scaling)

    monkeypatch.setattr(split_kv_decode, "split_kv_decode", split_kv)
    prompts = grouped_ids(make_prompt)
    runs = {"flash": shared_decoder(ending_model, tiny_tokenizer, "flash"),
            "split_kv_shared": shared_decoder(ending_model, tiny_tokenizer, "split_kv_shared", compact_rows=2)}
    input_ids, attention_mask = left_pad(prompts, runs["flash"].pad_id, torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
    with torch.inference_mode():
        tokens = {name: run.generate(input_ids, attention_mask, greedy, torch.Generator()).tolist()
                  for name, run in runs.items()}
    assert tokens["split_kv_shared"] == tokens["flash"]
    shared = runs["split_kv_shared"]
    assert shared._compact.decode[3] == "split_kv" and shared.stats.compact_steps > 0
    assert kernels and set(kernels) == {2}  # the compact state's 2 rows, nothing else through split_kv


def test_done_watch_keeps_the_done_vector_it_read():
    watch = DoneWatch(torch.device("cpu"), lag=DONE_LAG)
    done = [[False, False, False], [True, False, False], [True, False, True], [True, True, True]]
    seen = []
    for row in done:
        watch.all_done_before(torch.tensor(row))
        seen.append(None if watch.seen is None else watch.seen.tolist())
    assert seen == [None] * DONE_LAG + done[: len(done) - DONE_LAG]


def test_compact_decode_rows_setting_is_read_checked_and_off_by_default(ending_model, tiny_tokenizer):
    from SPA_agent.config import compose
    from SPA_agent.generators.hf import HFGenerator
    from SPA_agent.trainer.config_checks import check_config

    cfg = {"decoder": "static", "progress": False, "compact_decode_rows": 16}
    generator = HFGenerator.from_config(cfg, "tiny", tiny_tokenizer, model=ending_model)
    assert generator._static_decoder().compact_rows == 16
    for model in ("tiny", "smollm2-135m", "qwen2.5-0.5b"):
        assert compose("_2_sokoban", [f"model={model}"]).generator.compact_decode_rows == 0
    cfg = compose("_2_sokoban", ["model=tiny", "actor_rollout_ref.rollout.compact_decode_rows=16"])
    assert cfg.generator.compact_decode_rows == 16
    check_config(cfg)
    with pytest.raises(ValueError, match="generator.compact_decode_rows"):
        check_config(compose("_2_sokoban", ["model=tiny", "generator.compact_decode_rows=-1"]))
    with pytest.raises(ValueError, match="generator.compact_decode_rows must be an integer"):
        HFGenerator(ending_model, tiny_tokenizer, SamplingParams(), compact_decode_rows=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("attention", ["flash", "split_kv"], ids=["masked", "split_kv"])
def test_compacted_cuda_graphs_sample_what_the_full_batch_samples_in_float32_on_gpu(
        ending_model, tiny_tokenizer, prompts_of_lengths, attention):
    """On a GPU in float32 with kept CUDA graphs (the compact state's captured at its first use, then replayed):
    sampled and greedy calls give the tokens of the decoder without compaction, so the CUDA random stream does not
    depend on the logits' values either, and the keys copied in and back are the right rows'."""
    if attention == "split_kv" and not split_kv_decode.available():
        pytest.skip("the split-KV kernel needs triton")
    model = copy.deepcopy(ending_model).to("cuda")
    full = compacted(model, tiny_tokenizer, SAMPLED, 0, keep_decode_graphs=True, decode_attention=attention)
    compact = compacted(model, tiny_tokenizer, SAMPLED, 4, keep_decode_graphs=True, decode_attention=attention)
    for sampling in (SAMPLED, SamplingParams(temperature=0.0, max_new_tokens=32)):
        full.sampling = compact.sampling = sampling
        for lengths in (LENGTHS, LENGTHS[:7], LENGTHS):
            prompts = prompts_of_lengths(lengths)
            assert ids(compact.generate(prompts)) == ids(full.generate(prompts))
    decoder = compact._static
    assert decoder.stats.compact_steps > 0 and decoder._compact.graph is not None
    assert decoder.last_capture_s == 0.0  # the last call replayed kept graphs, the compact one's included


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_compacted_turns_with_the_reused_prefix_cache_on_gpu(ending_model, tiny_tokenizer):
    """Turn by turn over the kept buffer with CUDA graphs, greedy, in float32 on a GPU: the turns and the reused
    tokens of the decoder without compaction, so the keys copied back by the device are in their rows. Every compact
    step replayed the compact state's graph: counted, since the state itself is gone by the end (on GPU the cache
    lengths round up to PROMPT_BUCKET, so turn 3 regrows the kept buffer, which drops every state; the later turns
    have too few rows to compact)."""
    model = copy.deepcopy(ending_model).to("cuda")
    full, full_decoder = by_call(model, tiny_tokenizer, GREEDY, compact_rows=0)
    compact, decoder = by_call(model, tiny_tokenizer, GREEDY, compact_rows=3)
    assert compact.turns == full.turns
    assert decoder.stats.compact_steps > 0 and decoder.stats.reused_tokens == full_decoder.stats.reused_tokens > 0
    assert decoder.stats.compact_graph_steps == decoder.stats.compact_steps

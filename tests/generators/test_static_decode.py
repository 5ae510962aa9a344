"""The static-cache decoder (issues 9, 17) against transformers' generate on the tiny model, on CPU (no CUDA
graphs); its flash-attention decode path against the masked one on a GPU. Kept decode graphs
(generator.keep_decode_graphs): test_kept_decode_graphs.py."""

from __future__ import annotations

import copy

import pytest
import torch

from SPA_agent.generators import SamplingParams
from SPA_agent.generators.hf import HFGenerator, end_of_turn_ids
from SPA_agent.generators.static_decode import (
    DECODE_KWARG,
    DONE_LAG,
    DoneWatch,
    decode_attention,
    filter_logits,
    left_aligned,
)

REPEATS = [1, 12, 3, 40]


def hf(model, tokenizer, sampling, decoder, batch_size=8, **settings):
    """The generator with flash attention's decode path unless `settings` name another (the Triton split-KV kernel
    has its own tests)."""
    settings = {"decode_attention": "flash", **settings}
    return HFGenerator(model, tokenizer, sampling, batch_size=batch_size, decoder=decoder, progress=False,
                       **settings)


def ids(generations):
    return [g.token_ids for g in generations]


@pytest.mark.parametrize("max_new_tokens", [1, 12])
def test_greedy_static_decoder_equals_generate(
    varied_model, tiny_tokenizer, prompts_of_lengths, max_new_tokens
):
    prompts = prompts_of_lengths(REPEATS)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    static = hf(varied_model, tiny_tokenizer, greedy, "static").generate(prompts)
    plain = hf(varied_model, tiny_tokenizer, greedy, "generate").generate(prompts)
    assert ids(static) == ids(plain)
    assert [g.finish_reason for g in static] == [g.finish_reason for g in plain]
    assert [g.text for g in static] == [g.text for g in plain]


def test_stops_per_sequence_and_respects_length(varied_model, tiny_tokenizer, prompts_of_lengths, greedy_reference):
    """Each row stops where the plainest greedy loop meets an end of turn, or runs to max_new_tokens."""
    prompts = prompts_of_lengths(REPEATS)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    stop_ids = set(end_of_turn_ids(varied_model, tiny_tokenizer))
    expected = [greedy_reference(varied_model, p.prompt_ids, 20, stop_ids) for p in prompts]
    assert {reason for _, reason in expected} == {"stop", "length"}  # both ends occur in this batch
    generations = hf(varied_model, tiny_tokenizer, greedy, "static").generate(prompts)
    assert [(g.token_ids, g.finish_reason) for g in generations] == expected


def test_all_sequences_stopped_ends_the_loop(varied_model, tiny_tokenizer, prompts_of_lengths):
    prompts = prompts_of_lengths([1, 1])
    model = copy.deepcopy(varied_model)
    first = hf(model, tiny_tokenizer, SamplingParams(temperature=0.0, max_new_tokens=3), "static").generate(
        prompts
    )
    model.generation_config.eos_token_id = [first[0].token_ids[1]]
    stopped = hf(model, tiny_tokenizer, SamplingParams(temperature=0.0, max_new_tokens=40), "static")
    assert ids(stopped.generate(prompts)) == [first[0].token_ids[:2]] * 2
    # both rows ended at step 1: the loop ran DONE_LAG decode steps past it (not to the 40-token cap)
    assert stopped._static.stats.decode_steps == 1 + DONE_LAG


def test_done_watch_says_all_done_lag_steps_after_the_last_row_ends():
    watch = DoneWatch(torch.device("cpu"), lag=3)
    done = [[False, False], [True, False], [True, False], [True, True], [True, True], [True, True], [True, True]]
    seen = [watch.all_done_before(torch.tensor(row)) for row in done]
    assert seen == [False, False, False, False, False, False, True]  # all done at step 3, read at step 3 + 3


def test_top_k_one_sampling_equals_greedy(varied_model, tiny_tokenizer, prompts_of_lengths):
    prompts = prompts_of_lengths([1, 5])
    top1 = SamplingParams(temperature=0.7, top_k=1, max_new_tokens=10)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    assert ids(hf(varied_model, tiny_tokenizer, top1, "static").generate(prompts)) == ids(
        hf(varied_model, tiny_tokenizer, greedy, "static").generate(prompts)
    )


def test_seeded_sampling_is_reproducible(varied_model, tiny_tokenizer, prompts_of_lengths):
    prompts = prompts_of_lengths([1, 5, 2])
    runs = [
        ids(
            hf(
                varied_model,
                tiny_tokenizer,
                SamplingParams(max_new_tokens=10, seed=seed),
                "static",
                batch_size=2,
            ).generate(prompts)
        )
        for seed in (4, 4, 5)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_filter_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    expected = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(10)(None, logits.clone()))
    torch.testing.assert_close(filter_logits(logits, 10, 0.8), expected)
    assert torch.equal(filter_logits(logits, -1, 1.0), logits)


class _Attention:
    num_key_value_groups, is_causal = 3, True


def _decode_inputs(device="cpu", dtype=torch.float32, batch=3, length=11, head_dim=8, kernel="flash"):
    """Random one-token queries (B, 6, 1, D), a cache (B, L, 2, D) and per-row key counts (the first is 1)."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(batch, 6, 1, head_dim, generator=gen)
    key, value = (torch.randn(batch, length, 2, head_dim, generator=gen) for _ in range(2))
    kv_lengths = torch.tensor([1, *torch.randint(2, length + 1, (batch - 1,), generator=gen).tolist()])
    rows = torch.arange(batch + 1)
    to = dict(device=device, dtype=dtype)
    decode = (kv_lengths.int().to(device), (rows * 3).int().to(device), (rows * length).int().to(device),  # G = 3
              kernel)
    return query.to(**to), key.to(**to), value.to(**to), kv_lengths, decode


def _reference_decode(query, key, value, kv_lengths):
    """Every query head against its repeated key/value head, keys past each row's length masked out."""
    from transformers.integrations.sdpa_attention import repeat_kv

    key, value = (repeat_kv(t.transpose(1, 2).float(), 3) for t in (key, value))
    mask = torch.arange(key.shape[2], device=key.device) < kv_lengths.to(key.device)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(query.float(), key, value, attn_mask=mask[:, None, None],
                                                           scale=0.5)
    return out.transpose(1, 2)


def test_decode_attention_reads_each_rows_prefix_of_the_cache():
    query, key, value, kv_lengths, decode = _decode_inputs()
    output, _ = decode_attention(_Attention(), query, key, value, None, scaling=0.5, **{DECODE_KWARG: decode})
    torch.testing.assert_close(output, _reference_decode(query, key, value, kv_lengths))
    # what lies past a row's length never matters: the unwritten tail and right padding
    key[0, 1:], value[0, 1:] = 1e4, -1e4
    again, _ = decode_attention(_Attention(), query, key, value, None, scaling=0.5, **{DECODE_KWARG: decode})
    torch.testing.assert_close(again, output)


def varlen_attention(query, key, value, cu_q, cu_k, kv_lengths, scale):
    """Flash attention's variable-length contract, unmasked within a row: the queries at positions
    [cu_q[b], cu_q[b+1]) read the keys at [cu_k[b], cu_k[b] + kv_lengths[b]); (positions, H_kv, D) in and out."""
    output = torch.empty_like(query)
    for b in range(len(kv_lengths)):
        queries, first = slice(cu_q[b], cu_q[b + 1]), int(cu_k[b])
        keys = slice(first, first + int(kv_lengths[b]))
        weights = torch.einsum("qhd,khd->hqk", query[queries], key[keys]).mul(scale).softmax(dim=-1)
        output[queries] = torch.einsum("hqk,khd->qhd", weights, value[keys])
    return output


def test_grouped_query_positions_give_every_query_heads_attention():
    """flash_decode runs the G query heads sharing a key/value head as G query positions of that head (cu_q = b·G):
    under the variable-length contract that layout gives each query head its own key/value head's attention."""
    from SPA_agent.generators.static_decode import grouped_queries, ungrouped_output

    query, key, value, kv_lengths, (lengths, cu_q, cu_k, _) = _decode_inputs(batch=4)
    batch, length, kv_heads, head_dim = key.shape
    grouped = grouped_queries(query, kv_heads)
    assert grouped.shape == (batch * 3, kv_heads, head_dim)
    output = varlen_attention(grouped, key.reshape(-1, kv_heads, head_dim), value.reshape(-1, kv_heads, head_dim),
                               cu_q, cu_k, lengths, 0.5)
    torch.testing.assert_close(ungrouped_output(output, batch), _reference_decode(query, key, value, kv_lengths))


def test_prefill_attention_is_causal_over_the_chunk():
    from transformers.integrations.sdpa_attention import repeat_kv

    gen = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(2, h, 5, 8, generator=gen) for h in (6, 2, 2))
    output, _ = decode_attention(_Attention(), query, key, value, None, scaling=0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 3), repeat_kv(value, 3), is_causal=True, scale=0.5
    ).transpose(1, 2)
    torch.testing.assert_close(output, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's decode kernel needs a CUDA GPU")
def test_flash_decode_equals_masked_reference_on_gpu():
    query, key, value, kv_lengths, decode = _decode_inputs("cuda", torch.bfloat16, batch=16, length=300, head_dim=64)
    output, _ = decode_attention(_Attention(), query, key, value, None, scaling=0.5, **{DECODE_KWARG: decode})
    torch.testing.assert_close(output.float(), _reference_decode(query, key, value, kv_lengths), atol=2e-2, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and flash decoding need a CUDA GPU")
def test_cuda_graph_flash_decoder_equals_generate_on_gpu(varied_model, tiny_tokenizer, prompts_of_lengths,
                                                        monkeypatch):
    """The static decoder as it runs on a GPU (every decode step a replay of a captured CUDA graph, attention by
    flash attention's variable-length kernel) gives generate's greedy tokens and finish reasons. float16: half
    precision, as flash attention needs, with more mantissa than bfloat16 against near-ties."""
    from SPA_agent.generators import static_decode

    if not static_decode._flash_capable(torch.device("cuda")):
        pytest.skip("flash attention needs an Ampere or newer GPU")
    flash_calls, replayed = [], []
    real_flash, real_step = static_decode.flash_decode, static_decode._DecodeState.step
    monkeypatch.setattr(static_decode, "flash_decode", lambda *a, **k: flash_calls.append(1) or real_flash(*a, **k))
    monkeypatch.setattr(static_decode._DecodeState, "step",
                        lambda self: replayed.append(self.graph is not None) or real_step(self))
    model = copy.deepcopy(varied_model).to("cuda", torch.float16)
    prompts = prompts_of_lengths([1, 2, 3, 5, 8, 12, 20, 40])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    static = hf(model, tiny_tokenizer, greedy, "static").generate(prompts)
    assert flash_calls and replayed and all(replayed)  # flash attention captured in the graph; every step replayed
    plain = hf(model, tiny_tokenizer, greedy, "generate").generate(prompts)
    assert [(g.token_ids, g.finish_reason) for g in static] == [(g.token_ids, g.finish_reason) for g in plain]


def test_left_aligned_moves_prompts_to_the_start_of_their_rows():
    input_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4], [0, 0, 0, 3]])
    prompts, lengths = left_aligned(input_ids, (input_ids != 0).long(), pad_id=0)
    assert prompts.tolist() == [[5, 6, 0, 0], [7, 8, 9, 4], [3, 0, 0, 0]]
    assert lengths.tolist() == [2, 4, 1]


def test_one_token_prompts_match_generate(varied_model, tiny_tokenizer):
    from SPA_agent.generators import Prompt

    prompts = [Prompt(messages=[], prompt_ids=[5]), Prompt(messages=[], prompt_ids=[7])]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    assert ids(hf(varied_model, tiny_tokenizer, greedy, "static").generate(prompts)) == ids(
        hf(varied_model, tiny_tokenizer, greedy, "generate").generate(prompts)
    )


def test_prefill_in_row_chunks_equals_one_prefill(varied_model, tiny_tokenizer, prompts_of_lengths):
    """A batch whose prefill runs in chunks of rows (generator.prefill_chunk_tokens) decodes the same greedy tokens."""
    prompts = prompts_of_lengths(REPEATS)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    whole = ids(hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None).generate(prompts))
    # one row per prefill forward
    assert ids(hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None,
                  prefill_chunk_tokens=1).generate(prompts)) == whole


@pytest.mark.parametrize("value", [0, -5, "many", 2.5, True])
def test_prefill_chunk_tokens_must_be_a_positive_integer(varied_model, tiny_tokenizer, value):
    with pytest.raises(ValueError, match=r"^generator.prefill_chunk_tokens must be a positive integer, got "):
        HFGenerator.from_config({"prefill_chunk_tokens": value, "progress": False}, "tiny", tiny_tokenizer,
                                model=varied_model)


def test_prefill_chunk_tokens_reach_the_decoder_from_the_config(varied_model, tiny_tokenizer):
    from SPA_agent.config import compose
    from SPA_agent.generators.static_decode import PREFILL_TOKENS

    cfg = compose("_2_sokoban", ["model=tiny", "generator.prefill_chunk_tokens=4096"]).generator
    generator = HFGenerator.from_config({**cfg, "decoder": "static", "progress": False}, "tiny", tiny_tokenizer,
                                        model=varied_model)
    assert generator._static_decoder().prefill_chunk_tokens == 4096
    assert compose("_2_sokoban", ["model=tiny"]).generator.prefill_chunk_tokens == PREFILL_TOKENS


@pytest.mark.parametrize("value", ["0", "many"])
def test_the_config_check_refuses_a_bad_prefill_chunk_tokens_before_any_model_loads(value):
    from SPA_agent.config import compose
    from SPA_agent.trainer.config_checks import check_config

    with pytest.raises(ValueError, match=r"^generator.prefill_chunk_tokens must be"):
        check_config(compose("_2_sokoban", ["model=tiny", f"generator.prefill_chunk_tokens={value}"]))


def test_prefill_chunks_take_the_longest_prompts_first(varied_model, tiny_tokenizer, prompts_of_lengths):
    """Prefill chunks hold prompts of similar lengths, longest first, each as wide as its own longest prompt;
    the greedy tokens are those of one prefill of the whole batch, in the batch's order."""
    prompts = prompts_of_lengths(REPEATS)  # lengths 1 < 12 < 3 < 40 repeats, not in batch order
    lengths = sorted((len(p.prompt_ids) for p in prompts), reverse=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    whole = ids(hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None).generate(prompts))
    # two of the longest prompts a chunk
    generator = hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None, prefill_chunk_tokens=2 * lengths[0])
    assert ids(generator.generate(prompts)) == whole
    # chunks {40, 12} and {3, 1} repeats: 2 rows as wide as the longest prompt, then 2 as wide as the third
    # (in batch order they were {1, 12} and {3, 40}, the second as wide as the longest)
    assert generator._static.stats.prefill_tokens == 2 * lengths[0] + 2 * lengths[2]


def test_auto_limits_on_cpu_are_64_sequences_and_no_token_limit(varied_model, tiny_tokenizer):
    generator = HFGenerator(varied_model, tiny_tokenizer, SamplingParams(), batch_size="auto",
                            max_batch_tokens="auto")
    assert generator.batch_size == 64
    from SPA_agent.generators.hf import auto_batch_tokens

    assert auto_batch_tokens(varied_model) is None


def test_decode_batches_follow_row_and_token_limits():
    from SPA_agent.generators.hf import decode_batches

    lengths = [30, 10, 20, 10]  # sorted: 1, 3 (10), 2 (20), 0 (30)
    assert decode_batches(lengths, 5, None, None) == [[1, 3, 2, 0]]
    assert decode_batches(lengths, 5, 3, None) == [[1, 3, 2], [0]]
    # cache tokens: 2 × (10 + 5) = 30 fits 50; 3 × (20 + 5) = 75 does not; 2 × (30 + 5) = 70 does not
    assert decode_batches(lengths, 5, None, 50) == [[1, 3], [2], [0]]
    assert decode_batches(lengths, 5, None, 1) == [[1], [3], [2], [0]]  # each alone, even over the limit
    assert decode_batches(lengths, 5, None, 30, bucket=16) == [[1], [3], [2], [0]]  # widths 16 + 5 = 21 each


@pytest.mark.slow
def test_compiled_decode_step_samples_what_the_eager_step_samples(varied_model, tiny_tokenizer, prompts_of_lengths):
    """generator.compile_decode_step: the same samples (float32, temperature 1), and one compiled graph for every
    batch size and cache length (dynamic shapes), so a rollout's changing shapes do not recompile."""
    import torch._dynamo.utils

    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)
    shapes = [REPEATS, [60, 2, 9], [5, 90, 30, 3, 14]]  # new batch sizes and cache lengths
    eager = [ids(hf(varied_model, tiny_tokenizer, sampling, "static", None).generate(prompts_of_lengths(s)))
             for s in shapes]
    torch._dynamo.reset()
    generator = HFGenerator(varied_model, tiny_tokenizer, sampling, batch_size=None, decoder="static",
                            progress=False, compile_decode_step=True)
    for lengths, expected in zip(shapes, eager):
        generator._calls = 0  # each call samples from the same seed as the eager generator's first call
        assert ids(generator.generate(prompts_of_lengths(lengths))) == expected
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_finished_rows_read_one_key_and_running_rows_are_unchanged(
    varied_model, tiny_tokenizer, prompts_of_lengths, greedy_reference, monkeypatch
):
    """A row that has emitted its end of turn attends to its first key only from the next decode step on, so a
    turn's long tail no longer reads the finished rows' histories; the other rows decode exactly as the plainest
    greedy loop does."""
    from SPA_agent.generators import static_decode

    read = []  # keys each row reads, per decode step
    real = static_decode.masked_decode
    monkeypatch.setattr(static_decode, "masked_decode",
                        lambda q, k, v, lengths, scaling=None: read.append(lengths.tolist()) or real(q, k, v, lengths,
                                                                                                    scaling))
    prompts = prompts_of_lengths(REPEATS)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    generations = hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None).generate(prompts)
    stop_ids = set(end_of_turn_ids(varied_model, tiny_tokenizer))
    assert [(g.token_ids, g.finish_reason) for g in generations] == [
        greedy_reference(varied_model, p.prompt_ids, 20, stop_ids) for p in prompts]
    layers = varied_model.config.num_hidden_layers
    assert len(read) == 19 * layers  # one row runs to the length limit: 19 decode steps after the prefill's token
    assert all(read[i] == read[i - i % layers] for i in range(len(read)))  # every layer of a step reads alike
    for step, lengths in enumerate(read[::layers]):  # decode step `step` feeds each row its token `step`
        expected = [1 if g.finish_reason == "stop" and len(g.token_ids) - 1 <= step else len(p.prompt_ids) + step + 1
                    for g, p in zip(generations, prompts)]
        assert sorted(lengths) == sorted(expected)  # (the decode batch orders rows by prompt length)
    assert any(g.finish_reason == "stop" and len(g.token_ids) < 19 for g in generations)  # some rows finished early

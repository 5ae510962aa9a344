"""The static-cache decoder (issue 9) against transformers' generate on the tiny model, on CPU (no CUDA
graphs)."""

from __future__ import annotations

import copy

import pytest
import torch

from SPA_agent.generators import SamplingParams
from SPA_agent.generators.hf import HFGenerator
from SPA_agent.generators.static_decode import filter_logits, grouped_sdpa_attention

REPEATS = [1, 12, 3, 40]


def hf(model, tokenizer, sampling, decoder, batch_size=8):
    return HFGenerator(model, tokenizer, sampling, batch_size=batch_size, decoder=decoder, progress=False)


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


def test_stops_per_sequence_and_respects_length(varied_model, tiny_tokenizer, prompts_of_lengths):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    generations = hf(varied_model, tiny_tokenizer, greedy, "static").generate(prompts_of_lengths(REPEATS))
    assert len(generations[0].token_ids) == 9 and generations[0].finish_reason == "stop"  # <|im_end|>
    assert all(len(g.token_ids) == 20 and g.finish_reason == "length" for g in generations[1:])


def test_all_sequences_stopped_ends_the_loop(varied_model, tiny_tokenizer, prompts_of_lengths):
    prompts = prompts_of_lengths([1, 1])
    model = copy.deepcopy(varied_model)
    first = hf(model, tiny_tokenizer, SamplingParams(temperature=0.0, max_new_tokens=3), "static").generate(
        prompts
    )
    model.generation_config.eos_token_id = [first[0].token_ids[1]]
    stopped = hf(model, tiny_tokenizer, SamplingParams(temperature=0.0, max_new_tokens=40), "static")
    assert ids(stopped.generate(prompts)) == [first[0].token_ids[:2]] * 2


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


def test_grouped_decode_attention_equals_repeated_heads():
    from transformers.integrations.sdpa_attention import repeat_kv

    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(3, h, q, 8, generator=gen) for h, q in ((6, 1), (2, 11), (2, 11)))
    mask = torch.rand(3, 1, 1, 11, generator=gen) > 0.3
    mask[..., 0] = True

    class Module:
        num_key_value_groups = 3

    output, _ = grouped_sdpa_attention(Module(), query, key, value, mask, scaling=0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=mask, scale=0.5
    ).transpose(1, 2)
    torch.testing.assert_close(output, expected)


def test_one_token_prompts_match_generate(varied_model, tiny_tokenizer):
    from SPA_agent.generators import Prompt

    prompts = [Prompt(messages=[], prompt_ids=[5]), Prompt(messages=[], prompt_ids=[7])]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    assert ids(hf(varied_model, tiny_tokenizer, greedy, "static").generate(prompts)) == ids(
        hf(varied_model, tiny_tokenizer, greedy, "generate").generate(prompts)
    )


def test_prefill_in_row_chunks_equals_one_prefill(varied_model, tiny_tokenizer, prompts_of_lengths, monkeypatch):
    """A batch whose prefill runs in chunks of rows (PREFILL_TOKENS) decodes the same greedy tokens."""
    from SPA_agent.generators import static_decode

    prompts = prompts_of_lengths(REPEATS)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    whole = ids(hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None).generate(prompts))
    monkeypatch.setattr(static_decode, "PREFILL_TOKENS", 1)  # one row per prefill forward
    assert ids(hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None).generate(prompts)) == whole


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

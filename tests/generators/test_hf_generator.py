"""The transformers generator on the tiny model: padding, stop conditions, lengths, seeding (spec §7.2)."""

from __future__ import annotations

import copy

import pytest
import torch

from SPA_agent.generators import SamplingParams, build_generator
from SPA_agent.generators.hf import HFGenerator, cut_at_stop, end_of_turn_ids, left_pad

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
REPEATS = [1, 12, 3, 40]  # user turns from ~20 to ~600 tokens


def hf(model, tokenizer, sampling=GREEDY, batch_size=8, decoder="generate"):
    return HFGenerator(model, tokenizer, sampling, batch_size=batch_size, decoder=decoder, progress=False)


def test_end_of_turn_ids_come_from_tokenizer_and_generation_config(tiny_model, tiny_tokenizer):
    expected = sorted(tiny_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    assert end_of_turn_ids(tiny_model, tiny_tokenizer) == expected


def test_left_pad_masks_padding():
    input_ids, attention_mask = left_pad([[5, 6, 7], [9]], pad_id=0, device="cpu")
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_cut_at_stop_keeps_end_of_turn_token():
    assert cut_at_stop([4, 5, 2, 2, 2], {2}) == ([4, 5, 2], "stop")
    assert cut_at_stop([4, 5, 6], {2}) == ([4, 5, 6], "length")


def test_generations_have_consistent_ids_text_and_finish_reason(
    tiny_model, tiny_tokenizer, prompts_of_lengths
):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    generations = hf(tiny_model, tiny_tokenizer, sampling).generate(prompts_of_lengths([1, 2, 5]))
    stop_ids = set(end_of_turn_ids(tiny_model, tiny_tokenizer))
    assert len(generations) == 3
    for generation in generations:
        assert 1 <= len(generation.token_ids) <= 10
        assert not stop_ids & set(generation.token_ids[:-1])  # nothing after the end of turn, no padding
        assert generation.finish_reason == ("stop" if generation.token_ids[-1] in stop_ids else "length")
        assert generation.text == tiny_tokenizer.decode(generation.token_ids, skip_special_tokens=True)


def test_padded_batch_equals_each_prompt_alone_greedy(varied_model, tiny_tokenizer, prompts_of_lengths):
    prompts = prompts_of_lengths(REPEATS)
    assert max(len(p.prompt_ids) for p in prompts) > 10 * min(len(p.prompt_ids) for p in prompts)
    batched = hf(varied_model, tiny_tokenizer).generate(prompts)
    alone = [hf(varied_model, tiny_tokenizer).generate([prompt])[0] for prompt in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]
    assert [len(set(g.token_ids)) > 5 for g in batched] == [True] * len(prompts)


def test_stops_at_end_of_turn_token_per_sequence(varied_model, tiny_tokenizer, prompts_of_lengths,
                                                 greedy_reference):
    """Each row stops where the plainest greedy loop meets an end of turn (the token kept, not in the text);
    the others run to max_new_tokens."""
    prompts = prompts_of_lengths(REPEATS)
    stop_ids = set(end_of_turn_ids(varied_model, tiny_tokenizer))
    expected = [greedy_reference(varied_model, p.prompt_ids, GREEDY.max_new_tokens, stop_ids) for p in prompts]
    assert {reason for _, reason in expected} == {"stop", "length"}  # both ends occur in this batch
    generations = hf(varied_model, tiny_tokenizer).generate(prompts)
    assert [(g.token_ids, g.finish_reason) for g in generations] == expected
    for generation in generations:
        assert generation.text == tiny_tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        assert "<|im_end|>" not in generation.text


def test_extra_end_of_turn_id_from_generation_config_cuts_there(
    varied_model, tiny_tokenizer, prompts_of_lengths
):
    prompts = prompts_of_lengths(REPEATS)
    free = hf(varied_model, tiny_tokenizer).generate(prompts)
    stop_token = free[1].token_ids[3]
    assert stop_token not in free[1].token_ids[:3]
    model = copy.deepcopy(varied_model)
    model.generation_config.eos_token_id = [*model.generation_config.eos_token_id, stop_token]
    stopped = hf(model, tiny_tokenizer).generate(prompts)
    for before, after in zip(free, stopped):
        if stop_token in before.token_ids:
            cut = before.token_ids.index(stop_token) + 1
            assert after.token_ids == before.token_ids[:cut] and after.finish_reason == "stop"
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == before.finish_reason
    assert stopped[1].token_ids == free[1].token_ids[:4]


def test_max_new_tokens_is_respected(tiny_model, tiny_tokenizer, prompts_of_lengths):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5)
    for generation in hf(tiny_model, tiny_tokenizer, sampling, batch_size=2).generate(
        prompts_of_lengths(REPEATS)
    ):
        assert len(generation.token_ids) == 5 and generation.finish_reason == "length"


def test_seeded_sampling_is_reproducible(tiny_model, tiny_tokenizer, prompts_of_lengths):
    prompts = prompts_of_lengths([1, 3, 2])

    def sample(seed):
        generator = hf(tiny_model, tiny_tokenizer, SamplingParams(max_new_tokens=12, seed=seed), batch_size=2)
        return [[g.token_ids for g in generator.generate(prompts)] for _ in range(2)]

    first, again, other = sample(0), sample(0), sample(1)
    assert first == again
    assert first != other
    assert first[0] != first[1]  # consecutive calls draw fresh samples


def test_top_k_one_equals_greedy(varied_model, tiny_tokenizer, prompts_of_lengths):
    prompts = prompts_of_lengths([1, 4])
    top1 = hf(varied_model, tiny_tokenizer, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=12))
    assert [g.token_ids for g in top1.generate(prompts)] == [
        g.token_ids for g in hf(varied_model, tiny_tokenizer).generate(prompts)
    ]


def test_checkpoint_generation_config_does_not_change_sampling(
    varied_model, tiny_tokenizer, prompts_of_lengths
):
    prompts = prompts_of_lengths([1, 4])
    model = copy.deepcopy(varied_model)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.no_repeat_ngram_size = 1
    assert [g.token_ids for g in hf(model, tiny_tokenizer).generate(prompts)] == [
        g.token_ids for g in hf(varied_model, tiny_tokenizer).generate(prompts)
    ]


def test_build_from_config_loads_the_tiny_model(tiny_config, tiny_tokenizer, make_prompt):
    cfg = tiny_config("_2_sokoban", "generator=hf", "generator.max_new_tokens=4").generator
    generator = build_generator(cfg, "tiny", tiny_tokenizer)
    assert generator.decoder == ("static" if torch.cuda.is_available() else "generate")  # the device's default
    (generation,) = generator.generate([make_prompt("Turn 1")])
    assert len(generation.token_ids) <= 4


def test_training_mode_is_restored(tiny_model, tiny_tokenizer, make_prompt):
    model = copy.deepcopy(tiny_model).train()
    hf(model, tiny_tokenizer).generate([make_prompt("Turn 1")])
    assert model.training


def test_bad_settings_are_clear_errors(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="decoder"):
        hf(tiny_model, tiny_tokenizer, decoder="fast")
    with pytest.raises(ValueError, match="unknown generator"):
        build_generator({"name": "nope"}, "tiny", tiny_tokenizer)


def test_a_redirected_decode_prints_a_heartbeat_and_decodes_the_same(tiny_model, tiny_tokenizer, prompts_of_lengths,
                                                                      monkeypatch, capsys):
    """With progress on and stderr redirected, transformers' generate prints a plain line every HEARTBEAT_S
    seconds (here 0: every step); the tokens are those of a silent run."""
    from SPA_agent.runs import progress

    prompts = prompts_of_lengths([1, 2])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3, seed=5)
    silent = HFGenerator(tiny_model, tiny_tokenizer, sampling, progress=False).generate(prompts)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.0)
    shown = HFGenerator(tiny_model, tiny_tokenizer, sampling, progress=True).generate(prompts)
    assert [g.token_ids for g in shown] == [g.token_ids for g in silent]
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"generate: {n} new tokens of 2 sequences" for n in (1, 2, 3)]

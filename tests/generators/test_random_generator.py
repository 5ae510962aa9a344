"""The random-action generator: well-formed responses, actions from the prompt's action space (spec §7.4)."""

from __future__ import annotations

import re

import pytest

from SPA_agent.generators import build_generator
from SPA_agent.generators.random import RandomGenerator, last_states

SOKOBAN_ACTIONS = ["Up", "Down", "Left", "Right"]


WORLDMODEL = re.compile(
    r"^<think>\s*<observation>(.*?)</observation>(.*?)<prediction>(.*?)</prediction>\s*</think>\s*"
    r"<answer>(.*?)</answer>$",
    re.DOTALL,
)
BASE = re.compile(r"^<think>(.*?)</think>\s*<answer>(.*?)</answer>$", re.DOTALL)


def actions_of(answer: str) -> list[str]:
    return [piece.strip() for piece in answer.split("||") if piece.strip()]


def test_base_mode_is_well_formed_with_actions_from_action_space(make_prompt):
    prompts = [make_prompt("Turn 1") for _ in range(20)]
    generations = RandomGenerator(num_actions=3, seed=0).generate(prompts)
    for generation in generations:
        match = BASE.match("<think>" + generation.text)
        assert match, generation.text
        actions = actions_of(match.group(2))
        assert len(actions) == 3 and set(actions) <= set(SOKOBAN_ACTIONS)
        assert generation.token_ids is None and generation.finish_reason == "stop"
    every_action = {a for g in generations for a in actions_of(BASE.match("<think>" + g.text).group(2))}
    assert every_action == set(SOKOBAN_ACTIONS)  # 60 uniform draws over 4 names cover all of them


def test_worldmodel_mode_copies_states_of_last_assistant_message(make_prompt):
    history = [
        {"role": "user", "content": "Turn 1"},
        {
            "role": "assistant",
            "content": "<think> <observation>old</observation> x <prediction>p</prediction>"
            "</think><answer>Up</answer>",
        },
        {"role": "user", "content": "Reward:\n-0.1\n"},
        {
            "role": "assistant",
            "content": "<think> <observation>#P\n_O</observation> y "
            "<prediction>#_\nPO</prediction></think><answer>Down</answer>",
        },
    ]
    prompt = make_prompt("Turn 3", history=history, worldmodel=True)
    (generation,) = RandomGenerator(num_actions=2, seed=1).generate([prompt])
    match = WORLDMODEL.match("<think>" + generation.text)
    assert match, generation.text
    assert (match.group(1), match.group(3)) == ("#P\n_O", "#_\nPO")
    assert len(actions_of(match.group(4))) == 2


def test_worldmodel_first_turn_has_empty_states(make_prompt):
    (generation,) = RandomGenerator().generate([make_prompt("Turn 1", worldmodel=True)])
    match = WORLDMODEL.match("<think>" + generation.text)
    assert match and match.group(1) == "" and match.group(3) == ""


def test_answer_prefix_gives_bare_answer(make_prompt):
    (generation,) = RandomGenerator(num_actions=1).generate([make_prompt("t", prefix="<answer>")])
    assert re.fullmatch(r"(Up|Down|Left|Right)</answer>", generation.text)


def test_seeded_and_built_from_config(tiny_config, tiny_tokenizer, make_prompt):
    cfg = tiny_config("_2_sokoban", "generator=random").generator
    prompts = [make_prompt("Turn 1") for _ in range(5)]
    first = build_generator(cfg, "tiny", tiny_tokenizer).generate(prompts)
    second = build_generator(cfg, "tiny", tiny_tokenizer).generate(prompts)
    assert [g.text for g in first] == [g.text for g in second]


def test_missing_action_space_is_a_clear_error(make_prompt):
    prompt = make_prompt("Turn 1")
    prompt.action_space = []
    with pytest.raises(ValueError, match="action_space"):
        RandomGenerator().generate([prompt])


def test_last_states_without_assistant_turn():
    assert last_states([{"role": "user", "content": "<observation>x</observation>"}]) == ("", "")


def test_random_generator_state_round_trip_continues_the_same_sequence():
    from SPA_agent.generators.base import Prompt
    from SPA_agent.generators.random import RandomGenerator

    prompts = [Prompt(messages=[], prompt_ids=[], action_space=["Up", "Down", "Left", "Right"])] * 4
    first = RandomGenerator(num_actions=3, seed=7)
    first.generate(prompts)
    state = first.state_dict()
    expected = [g.text for g in first.generate(prompts)]
    second = RandomGenerator(num_actions=3, seed=7)
    second.load_state_dict(state)
    assert [g.text for g in second.generate(prompts)] == expected

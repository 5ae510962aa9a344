"""`step` of every env takes any string a model can write (issue 12): an unreadable action is an invalid
action (spec §3.4), never an exception that would end the whole rollout."""

import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from SPA_agent.envs import make_env

# Numbers as a model may write them, among them characters that look like digits to `str.isdigit` or
# `int` without being ASCII digits: superscript, circled, Arabic-Indic, fullwidth, Devanagari, Roman.
NUMBERS = "1 2 3 4 0 10 01 -1 +2 1_0 0x1 1e0 ² ① ٣ ３ ४ Ⅳ ½".split() + ["7" * 4400]
WORDS = ["Up", "down", "LEFT", " Right ", ",", " ", "\n", "||", "row", "col", "place", "at", "\x00", "İ"]
MOVES = st.one_of(
    st.lists(st.sampled_from(NUMBERS), min_size=3, max_size=4).map(",".join),
    st.tuples(*[st.sampled_from(NUMBERS)] * 3).map(lambda n: "place {} at row {} col {}".format(*n)),
)
ANSWERS = st.one_of(
    st.text(max_size=40),
    MOVES,
    st.lists(st.sampled_from(NUMBERS + WORDS), max_size=8).map("".join),
    st.lists(st.sampled_from(NUMBERS + WORDS) | st.text(max_size=3), max_size=8).map(" ".join),
)
INFO_TYPES = {"success": bool, "action_is_valid": bool, "action_is_effective": bool}
PROPERTY = settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def _step(env, action):
    obs, reward, done, info = env.step(action)
    assert isinstance(obs, str) and isinstance(reward, float) and isinstance(done, bool)
    assert {k: type(v) for k, v in info.items()} == INFO_TYPES
    return obs, reward, done, info


@pytest.mark.parametrize("name, seed, invalid_reward", [("sokoban", 125, -0.1), ("frozen_lake", 123, 0.0)])
@PROPERTY
@given(action=ANSWERS)
def test_grid_env_step_accepts_any_string(name, seed, invalid_reward, action):
    env = make_env(name)
    before = env.reset(seed=seed)
    obs, reward, done, info = _step(env, action)
    named = action.strip().lower() in {"up", "down", "left", "right"}
    assert info["action_is_valid"] == named
    if not named:
        assert obs == before and reward == invalid_reward and not info["action_is_effective"]
        if name == "frozen_lake":
            assert not done


@PROPERTY
@given(action=ANSWERS)
@example(action="²,1,1")  # the reproduction of issue 12
def test_sudoku_step_accepts_any_string_and_reads_only_ascii_digits(action):
    env = make_env("sudoku")
    before = env.reset(seed=123)
    obs, _, _, info = _step(env, action)
    if not re.search("[1-4]", action):
        assert not info["action_is_valid"] and obs == before
    if info["action_is_effective"]:
        (changed,) = [(a, b) for a, b in zip(before.split(), obs.split()) if a != b]
        assert changed[0] == "." and changed[1] in action

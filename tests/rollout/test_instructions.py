"""The first user message follows the render mode: coordinates are promised and shown in the worked example
only when the states carry them (`text_with_coordinates`), never with the plain grid (`text`)."""

from __future__ import annotations

import re

import pytest

from SPA_agent.config import compose
from SPA_agent.envs import REGISTRY
from SPA_agent.rollout.ctx_manager import ContextManager
from SPA_agent.selfplay.worldmodel import extract_states, parse_state

COORDINATE_PAIR = re.compile(r"\(\d+,\d+\)")
#: env tags the experiments play (train or evaluation)
TAGS = ("SimpleSokoban", "HarderSokoban", "FrozenLake", "FrozenLake6x6", "Sudoku")


def _instruction(tag: str, render_mode: str, mode: str, tokenizer) -> str:
    cfg = compose("_2_sokoban", ["model=tiny", f"render_mode={render_mode}", f"ctx_manager.mode={mode}"])
    return ContextManager(cfg, tokenizer).instruction(tag)


@pytest.mark.parametrize("mode", ["base", "add_worldmodel"])
@pytest.mark.parametrize("tag", TAGS)
def test_plain_render_instruction_promises_no_coordinates(tag, mode, tiny_tokenizer):
    text = _instruction(tag, "text", mode, tiny_tokenizer)
    assert "coordinates" not in text and "Empty position" not in text and "is at (" not in text
    assert not COORDINATE_PAIR.search(text)


@pytest.mark.parametrize("tag", ["SimpleSokoban", "FrozenLake"])
def test_coordinate_render_instruction_describes_the_coordinates(tag, tiny_tokenizer):
    text = _instruction(tag, "text_with_coordinates", "base", tiny_tokenizer)
    assert "zero-indexed (row,col) coordinates" in text


@pytest.mark.parametrize("render_mode", ["text", "text_with_coordinates"])
@pytest.mark.parametrize("tag", ["SimpleSokoban", "FrozenLake", "Sudoku"])
def test_worked_example_states_look_like_real_renders(tag, render_mode, tiny_tokenizer):
    """The example's <observation> has a coordinate line exactly when a real render of that mode has one."""
    example = _instruction(tag, render_mode, "add_worldmodel", tiny_tokenizer)
    observations, predictions = extract_states(example)
    cfg = compose("_2_sokoban", ["model=tiny", f"render_mode={render_mode}"])
    env_cfg = cfg.custom_envs[tag]
    env_cls, config_cls = REGISTRY[env_cfg.env_type]
    env = env_cls(config_cls(**env_cfg.env_config))
    env.reset(seed=123)
    real = parse_state(env.render())
    states = [s for s in observations + predictions if s.strip()]  # skip "inside <observation></observation>"
    assert len(states) == 2
    for state in states:
        assert bool(parse_state(state).coords) == bool(real.coords)

"""Well-formed responses with uniformly random actions: the paper's random-action data ablation (spec §7.4).

In world-model mode the `<observation>` / `<prediction>` contents are copied from the last assistant message
of the chat (empty on the first turn), as the original `RandomActionWrapperWg` does; the context manager's
parser then reads a well-formed response whose actions are uniform over the env's action space.
"""

from __future__ import annotations

import random as _random
import re
from collections.abc import Mapping
from typing import Any

from SPA_agent.generators.base import FINISH_STOP, Generation, Prompt

ACTION_SEPARATOR = " || "
DEFAULT_REASONING = "I will push the box to the target."
_OBSERVATION = re.compile(r"<observation>(.*?)</observation>", re.DOTALL)
_PREDICTION = re.compile(r"<prediction>(.*?)</prediction>", re.DOTALL)


def last_states(messages: list[dict]) -> tuple[str, str]:
    """(observation, prediction) contents of the last assistant message; empty strings where absent."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            content = message.get("content") or ""
            observation, prediction = _OBSERVATION.search(content), _PREDICTION.search(content)
            return (observation.group(1) if observation else "", prediction.group(1) if prediction else "")
    return "", ""


class RandomGenerator:
    """Emits `num_actions` actions drawn uniformly (with replacement) from each prompt's `action_space`.

    The text is the continuation after `Prompt.response_prefix`: after `<think>` it closes the think block and
    gives the answer; after `<answer>` (think disabled) it is the bare action list and `</answer>`.
    """

    def __init__(self, num_actions: int = 3, seed: int = 0, reasoning: str = DEFAULT_REASONING):
        if num_actions < 1:
            raise ValueError(f"generator.num_actions must be >= 1, got {num_actions}")
        self.num_actions = num_actions
        self.reasoning = reasoning
        self._rng = _random.Random(seed)

    def state_dict(self) -> dict:
        """The RNG state, so a resumed run continues the same action sequence."""
        return {"rng": self._rng.getstate()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> RandomGenerator:
        return cls(
            num_actions=int(cfg.get("num_actions", 3)),
            seed=int(cfg.get("seed", 0)),
            reasoning=str(cfg.get("reasoning", DEFAULT_REASONING)),
        )

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        return [Generation(self._respond(prompt), None, FINISH_STOP) for prompt in prompts]

    def _respond(self, prompt: Prompt) -> str:
        if not prompt.action_space:
            raise ValueError(
                "the random generator needs Prompt.action_space (the env's action names); got none"
            )
        answer = ACTION_SEPARATOR.join(self._rng.choice(prompt.action_space) for _ in range(self.num_actions))
        if prompt.response_prefix.strip() == "<answer>":
            return f"{answer}</answer>"
        if prompt.worldmodel:
            observation, prediction = last_states(prompt.messages)
            think = (
                f" <observation>{observation}</observation> {self.reasoning} "
                f"<prediction>{prediction}</prediction>"
            )
        else:
            think = f" {self.reasoning} "
        return f"{think}</think><answer>{answer}</answer>"

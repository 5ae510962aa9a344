"""Parsing model responses into actions (spec §6.4). Pure functions; total: any string gives a result.

The parser sees the text *with* the forced prefix (`<think>`, or `<answer>` without thinking) that the
context manager opened the assistant turn with. A response that does not follow the format gets
`format_ok=False` and no actions, so the format penalty applies. Deviation from the original (spec §12.9):
in `add_worldmodel` mode, an answer without the observation/prediction structure used to become a *string*
of actions; here its answer is split like any other, and the turn is still marked as a format failure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

CONTROL_TAGS = (
    "<think>", "</think>", "<answer>", "</answer>", "<observation>", "</observation>",
    "<prediction>", "</prediction>", "<|im_start|>", "<|im_end|>",
)
BASE_PATTERN = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
ANSWER_ONLY_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
WORLDMODEL_PATTERN = re.compile(
    r"<think>\s*<observation>(.*?)</observation>(.*?)<prediction>(.*?)</prediction>\s*</think>\s*"
    r"<answer>(.*?)</answer>",
    re.DOTALL,
)

BASE_FORMAT = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
NO_THINK_FORMAT = "<answer> [your answer] </answer>"
WORLDMODEL_FORMAT = (
    "<think> <observation> [current state] </observation> [Your thoughts] "
    "<prediction> [next state]</prediction> </think> <answer> [your answer] </answer>"
)
MODES = ("base", "add_worldmodel")


@dataclass
class ParsedResponse:
    """What one assistant turn said. `normalized` is the cleaned response (spec §6.4)."""

    raw: str
    normalized: str
    actions: list[str] = field(default_factory=list)
    think: str = ""
    answer: str = ""
    observation: str | None = None
    prediction: str | None = None
    format_ok: bool = False

    def as_dict(self) -> dict:
        return {
            "think": self.think, "answer": self.answer, "observation": self.observation,
            "prediction": self.prediction, "format_ok": self.format_ok,
        }


def strip_tags(text: str) -> str:
    for tag in CONTROL_TAGS:
        text = text.replace(tag, "")
    return text.strip()


def split_actions(answer: str, action_sep: str, max_actions: int) -> tuple[list[str], str]:
    """Non-empty stripped pieces of the answer, at most `max_actions`; the answer text rebuilt if cut."""
    actions = [piece.strip() for piece in answer.split(action_sep) if piece.strip()]
    if len(actions) > max_actions:
        actions = actions[:max_actions]
        answer = f" {action_sep} ".join(actions)
    return actions, answer


def response_format(mode: str, enable_think: bool = True) -> str:
    """The FORMAT sentence shown in every turn's prompt (spec §6.2)."""
    if mode == "add_worldmodel":
        return WORLDMODEL_FORMAT
    return BASE_FORMAT if enable_think else NO_THINK_FORMAT


def parse_response(
    text: str, mode: str = "base", action_sep: str = "||", max_actions: int = 5, enable_think: bool = True
) -> ParsedResponse:
    """Parse one response (forced prefix included) into actions; never raises on any string."""
    if mode == "add_worldmodel":
        return _parse_worldmodel(text, action_sep, max_actions)
    if not enable_think:
        match = ANSWER_ONLY_PATTERN.search(text)
        if not match:
            return ParsedResponse(raw=text, normalized=text)
        actions, answer = split_actions(strip_tags(match.group(1)), action_sep, max_actions)
        return ParsedResponse(text, f"<answer>{answer}</answer>", actions, answer=answer, format_ok=True)
    match = BASE_PATTERN.search(text)
    if not match:
        return ParsedResponse(raw=text, normalized=text)
    think = strip_tags(match.group(1))
    actions, answer = split_actions(strip_tags(match.group(2)), action_sep, max_actions)
    normalized = f"<think>{think}</think><answer>{answer}</answer>"
    return ParsedResponse(text, normalized, actions, think=think, answer=answer, format_ok=True)


def _parse_worldmodel(text: str, action_sep: str, max_actions: int) -> ParsedResponse:
    match = WORLDMODEL_PATTERN.search(text)
    if match:
        observation, think, prediction = (strip_tags(match.group(i)) for i in (1, 2, 3))
        actions, answer = split_actions(strip_tags(match.group(4)), action_sep, max_actions)
        normalized = (
            f"<think> <observation>{observation}</observation> {think} "
            f"<prediction>{prediction}</prediction></think><answer>{answer}</answer>"
        )
        return ParsedResponse(text, normalized, actions, think, answer, observation, prediction, True)
    answer_match = ANSWER_ONLY_PATTERN.search(text)
    if not answer_match:
        return ParsedResponse(raw=text, normalized=text)
    actions, answer = split_actions(strip_tags(answer_match.group(1)), action_sep, max_actions)
    return ParsedResponse(raw=text, normalized=text, actions=actions, answer=answer, format_ok=False)

r"""Parsing model responses into actions (spec §6.4). Pure functions; total: any string gives a result.

The parser sees the text *with* the forced prefix (`<think>`, or `<answer>` without thinking) that the
context manager opened the assistant turn with. A response that does not follow the format gets
`format_ok=False` and no actions, so the format penalty applies. Deviation from the original (spec §12.9):
in `add_worldmodel` mode, an answer without the observation/prediction structure used to become a *string*
of actions; here its answer is split like any other, and the turn is still marked as a format failure.

Time is linear in the length of the response. The formats were first written as regexes with several lazy
groups (`<think>(.*?)</think>\s*<answer>(.*?)</answer>`), whose backtracking on a long response without
the closing tag grows like the cube of its length or faster (issue 12: 67 s for 8,400 characters in
add_worldmodel mode). Here the blocks are found left to right with `str.find` and regexes without lazy
groups, with the same results: a match of such a pattern, if there is one, starts at the first place the
pattern's opening can match, and each lazy group ends at the first closing text after it (a later one
would only make the group longer; if the rest cannot match after the first, it cannot after a later one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

CONTROL_TAGS = (
    "<think>", "</think>", "<answer>", "</answer>", "<observation>", "</observation>",
    "<prediction>", "</prediction>", "<|im_start|>", "<|im_end|>",
)
# The separators between blocks: a closing tag, optional whitespace (`\s`, as the original patterns had),
# the next opening tag. No lazy group, so a search is linear.
THINK_END = re.compile(r"</think>\s*<answer>")
WORLDMODEL_START = re.compile(r"<think>\s*<observation>")
WORLDMODEL_THINK_END = re.compile(r"</prediction>\s*</think>\s*<answer>")

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
        answer = find_answer(text)
        if answer is None:
            return ParsedResponse(raw=text, normalized=text)
        actions, answer = split_actions(strip_tags(answer), action_sep, max_actions)
        return ParsedResponse(text, f"<answer>{answer}</answer>", actions, answer=answer, format_ok=True)
    blocks = find_base_blocks(text)
    if blocks is None:
        return ParsedResponse(raw=text, normalized=text)
    think = strip_tags(blocks[0])
    actions, answer = split_actions(strip_tags(blocks[1]), action_sep, max_actions)
    normalized = f"<think>{think}</think><answer>{answer}</answer>"
    return ParsedResponse(text, normalized, actions, think=think, answer=answer, format_ok=True)


def _parse_worldmodel(text: str, action_sep: str, max_actions: int) -> ParsedResponse:
    blocks = find_worldmodel_blocks(text)
    if blocks is not None:
        observation, think, prediction = (strip_tags(block) for block in blocks[:3])
        actions, answer = split_actions(strip_tags(blocks[3]), action_sep, max_actions)
        normalized = (
            f"<think> <observation>{observation}</observation> {think} "
            f"<prediction>{prediction}</prediction></think><answer>{answer}</answer>"
        )
        return ParsedResponse(text, normalized, actions, think, answer, observation, prediction, True)
    answer = find_answer(text)
    if answer is None:
        return ParsedResponse(raw=text, normalized=text)
    actions, answer = split_actions(strip_tags(answer), action_sep, max_actions)
    return ParsedResponse(raw=text, normalized=text, actions=actions, answer=answer, format_ok=False)


def find_answer(text: str) -> str | None:
    """What `<answer>(.*?)</answer>` captures: the text from the first `<answer>` to the next `</answer>`."""
    start = text.find("<answer>")
    return None if start < 0 else _until(text, "</answer>", start + len("<answer>"))


def find_base_blocks(text: str) -> tuple[str, str] | None:
    r"""(think, answer) as the base format `<think>(.*?)</think>\s*<answer>(.*?)</answer>` captures them."""
    start = text.find("<think>")
    if start < 0:
        return None
    start += len("<think>")
    think_end = THINK_END.search(text, start)
    answer = None if think_end is None else _until(text, "</answer>", think_end.end())
    return None if answer is None else (text[start : think_end.start()], answer)


def find_worldmodel_blocks(text: str) -> tuple[str, str, str, str] | None:
    r"""(observation, thoughts, prediction, answer) as the world-model format captures them:
    `<think>\s*<observation>(.*?)</observation>(.*?)<prediction>(.*?)</prediction>\s*</think>\s*<answer>(.*?)</answer>`."""
    start = WORLDMODEL_START.search(text)
    if start is None:
        return None
    observation = _until(text, "</observation>", start.end())
    if observation is None:
        return None
    thoughts_start = start.end() + len(observation) + len("</observation>")
    thoughts = _until(text, "<prediction>", thoughts_start)
    if thoughts is None:
        return None
    prediction_start = thoughts_start + len(thoughts) + len("<prediction>")
    think_end = WORLDMODEL_THINK_END.search(text, prediction_start)
    answer = None if think_end is None else _until(text, "</answer>", think_end.end())
    if answer is None:
        return None
    return observation, thoughts, text[prediction_start : think_end.start()], answer


def _until(text: str, closing: str, start: int) -> str | None:
    """`text` from `start` up to the first `closing` at or after it; None if there is none."""
    end = text.find(closing, start)
    return None if end < 0 else text[start:end]

"""Response parsing is linear in the length (issue 12) and agrees with the regex parser it replaced.

`regex_parse` below is a frozen copy of the former parser, nested lazy regexes and all: the oracle for the
property test, run on short responses only (on long malformed ones it takes minutes).
"""

import re
import signal
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SPA_agent.rollout.parsing import ParsedResponse, parse_response, split_actions, strip_tags

# --- the former parser (oracle) ---------------------------------------------------------------------------
BASE_PATTERN = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
ANSWER_ONLY_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
WORLDMODEL_PATTERN = re.compile(
    r"<think>\s*<observation>(.*?)</observation>(.*?)<prediction>(.*?)</prediction>\s*</think>\s*"
    r"<answer>(.*?)</answer>",
    re.DOTALL,
)


def regex_parse(text, mode="base", action_sep="||", max_actions=5, enable_think=True):
    if mode == "add_worldmodel":
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


# --- ordinary responses: tags, whitespace (Unicode too) and short contents, well-formed or not -----------
TAGS = [
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<observation>",
    "</observation>",
    "<prediction>",
    "</prediction>",
    "<|im_end|>",
]
FILLER = [" ", "\n", "\t", "\u3000", "Up", "Left", "||", "2,1,3", "#_P\n", "<", ">", "/", "think", "answer"]
PIECE = st.sampled_from(TAGS + FILLER) | st.text(max_size=4)
CONTENT = st.lists(PIECE, max_size=4).map("".join)
SPACE = st.sampled_from(["", " ", "\n ", "\u3000"])


@st.composite
def worldmodel_shaped(draw):
    """The world-model format with random contents, sometimes cut short or followed by more text."""
    obs, thoughts, pred, answer = (draw(CONTENT) for _ in range(4))
    text = (
        f"<think>{draw(SPACE)}<observation>{obs}</observation>{thoughts}<prediction>{pred}"
        f"</prediction>{draw(SPACE)}</think>{draw(SPACE)}<answer>{answer}</answer>"
    )
    cut = draw(st.integers(0, len(text)))
    return draw(CONTENT) + text[: len(text) - cut] + draw(CONTENT) + (text if draw(st.booleans()) else "")


RESPONSES = st.one_of(st.lists(PIECE, max_size=24).map("".join), worldmodel_shaped())


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    text=RESPONSES,
    mode=st.sampled_from(["base", "add_worldmodel"]),
    think=st.booleans(),
    max_actions=st.integers(1, 3),
)
def test_parser_agrees_with_the_former_regex_parser(text, mode, think, max_actions):
    for candidate in (text, "<think>" + text, "<answer>" + text):
        expected = regex_parse(candidate, mode, "||", max_actions, think)
        assert parse_response(candidate, mode, "||", max_actions, think) == expected


# --- long malformed responses ---------------------------------------------------------------------------
LENGTH = 100_000
WORLDMODEL_TURN = "<think> <observation>a</observation> b <prediction>c</prediction> </think><answer>Up"
ADVERSARIAL = {  # name -> a unit repeated to LENGTH characters, plus an optional tail
    "issue_worldmodel": (WORLDMODEL_TURN, ""),  # issue 12: 67 s at 8,400 characters
    "issue_base": ("<think>ok</think><answer>Up", ""),  # issue 12: 19 s at 21,600 characters
    "issue_worldmodel_closed": (WORLDMODEL_TURN, "</answer>"),
    "issue_base_closed": ("<think>ok</think><answer>Up", "</answer>"),
    "think_open": ("<think>", ""),
    "answer_open": ("<answer>", ""),
    "observation_open": ("<think> <observation>", ""),
    "prediction_open": ("<think><observation>a</observation><prediction>b", ""),
    "no_answer": ("<think>x</think> ", ""),
    "think_end_run": ("</prediction> </think> <answer>", ""),
    "whitespace": ("<think>" + "</think>" + " " * 50, ""),
    "one_whitespace_run": ("<think></think>" + " " * LENGTH, ""),
    "two_whitespace_runs": (
        "<think> <observation>a</observation><prediction>b</prediction>"
        + " " * LENGTH
        + "</think>"
        + " " * LENGTH,
        "",
    ),
}


@contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError once this process has used `seconds` of CPU time (so a loaded machine does not
    matter). The regex engine checks for signals, so a runaway search (the former parser's) ends the test
    instead of hanging it."""

    def fail(signum, frame):
        raise TimeoutError(f"parsing took more than {seconds} s of CPU time")

    previous = signal.signal(signal.SIGPROF, fail)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_long_malformed_responses_parse_quickly(name):
    unit, tail = ADVERSARIAL[name]
    text = unit * (LENGTH // len(unit) + 1) + tail
    for mode, think in (("base", True), ("base", False), ("add_worldmodel", True)):
        with time_limit(0.5):
            parsed = parse_response(text, mode=mode, enable_think=think)
        assert len(parsed.actions) <= 5


def test_long_issue_responses_give_the_regex_results():
    """The issue's responses: without `</answer>` nothing matches; with one at the end, the first answer
    block runs to it. The regexes give the same on short copies of the same strings."""
    turns = WORLDMODEL_TURN * 1200
    with time_limit(0.5):
        parsed = parse_response(turns, mode="add_worldmodel")
    assert not parsed.format_ok and parsed.actions == [] and parsed.normalized == turns
    with time_limit(0.5):
        parsed = parse_response(turns + "</answer>", mode="add_worldmodel")
    assert parsed.format_ok and (parsed.observation, parsed.think, parsed.prediction) == ("a", "b", "c")
    assert parsed.actions == ["Up a b c " * 1199 + "Up"]
    with time_limit(0.5):
        parsed = parse_response("<think>ok</think><answer>Up" * 3700 + "</answer>")
    assert parsed.format_ok and parsed.think == "ok" and parsed.actions == ["Upok" * 3699 + "Up"]
    for repeats in (1, 3, 5):
        for unit, mode in ((WORLDMODEL_TURN, "add_worldmodel"), ("<think>ok</think><answer>Up", "base")):
            for short in (unit * repeats, unit * repeats + "</answer>"):
                assert parse_response(short, mode=mode) == regex_parse(short, mode=mode)

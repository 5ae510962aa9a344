"""State blocks are found in linear time (issue 12) with the results of the regexes they replaced."""

import gc
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SPA_agent.selfplay.worldmodel import Substitution, extract_states, substitute_states

# The former implementation (oracle), run on short texts only.
OBSERVATION_RE = re.compile(r"<observation>(.*?)</observation>", re.DOTALL)
PREDICTION_RE = re.compile(r"<prediction>(.*?)</prediction>", re.DOTALL)


def regex_substitute(response: str, observation: str, prediction: str) -> Substitution:
    obs_text, num_obs = OBSERVATION_RE.subn(lambda _: f"<observation>{observation}</observation>", response)
    text, num_pred = PREDICTION_RE.subn(lambda _: f"<prediction>{prediction}</prediction>", obs_text)
    return Substitution(text, num_obs, num_pred)


PIECES = [
    "<observation>",
    "</observation>",
    "<prediction>",
    "</prediction>",
    "<think>",
    "</answer>",
    "a",
    " ",
    "\n",
    "\\1",
    "<",
    "/",
    "observation>",
]
TEXTS = st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=20).map("".join)
STATES = st.sampled_from(["S", "", "<prediction>p</prediction>", "\\g<0>", "</observation>"])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=TEXTS, observation=STATES, prediction=STATES)
def test_blocks_agree_with_the_former_regexes(text, observation, prediction):
    assert extract_states(text) == (OBSERVATION_RE.findall(text), PREDICTION_RE.findall(text))
    assert substitute_states(text, observation, prediction) == regex_substitute(text, observation, prediction)


@pytest.mark.parametrize(
    "unit", ["<observation>", "<prediction>x ", "<observation>a</observation><prediction>", "</observation>"]
)
def test_long_responses_with_unclosed_blocks_are_quick(unit):
    text = unit * (100_000 // len(unit) + 1)
    # The garbage collector off while timing: the 2,501 blocks of one unit made a full collection of the test
    # session's heap (~0.5 s) fall inside the timed calls in the whole suite's run, a cost that is not theirs.
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        observations, predictions = extract_states(text)
        substitution = substitute_states(text, "S0", "S1")
        seconds = time.process_time() - start
    finally:
        gc.enable()
    assert seconds < 0.25  # CPU seconds; the regexes took about 2.5 s
    assert len(observations) == substitution.num_observations
    assert len(predictions) == substitution.num_predictions

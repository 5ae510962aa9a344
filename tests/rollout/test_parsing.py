from hypothesis import given, settings
from hypothesis import strategies as st

from SPA_agent.rollout.parsing import parse_response


def test_base_match_normalizes_and_splits_actions():
    parsed = parse_response("<think> go up </think> <answer> Up || Left ||  </answer>")
    assert parsed.format_ok and parsed.actions == ["Up", "Left"]
    assert parsed.normalized == "<think>go up</think><answer>Up || Left ||</answer>"  # answer kept as written


def test_more_than_max_actions_are_cut_and_answer_rebuilt():
    parsed = parse_response("<think>x</think><answer>Up||Up||Up||Up||Up||Down||Left</answer>", max_actions=5)
    assert parsed.actions == ["Up"] * 5
    assert parsed.normalized == "<think>x</think><answer>Up || Up || Up || Up || Up</answer>"


def test_missing_answer_is_a_format_failure_with_raw_text():
    parsed = parse_response("<think>I will go up")
    assert not parsed.format_ok and parsed.actions == [] and parsed.normalized == "<think>I will go up"


def test_unknown_action_names_are_kept_for_the_env_manager_to_drop():
    parsed = parse_response("<think>x</think><answer>Jump || Up</answer>")
    assert parsed.actions == ["Jump", "Up"]


def test_empty_answer_has_no_actions():
    parsed = parse_response("<think>x</think><answer></answer>")
    assert parsed.format_ok and parsed.actions == []


def test_wrong_case_tags_do_not_match():
    assert not parse_response("<THINK>x</THINK><ANSWER>Up</ANSWER>").format_ok


def test_worldmodel_match_extracts_states():
    text = ("<think> <observation>#P#\nPlayer (P) is at (0,1).</observation> push it "
            "<prediction>#_P</prediction> </think><answer>Right</answer>")
    parsed = parse_response(text, mode="add_worldmodel")
    assert parsed.format_ok and parsed.actions == ["Right"]
    assert parsed.observation == "#P#\nPlayer (P) is at (0,1)." and parsed.prediction == "#_P"
    assert parsed.normalized == (
        "<think> <observation>#P#\nPlayer (P) is at (0,1).</observation> push it "
        "<prediction>#_P</prediction></think><answer>Right</answer>"
    )


def test_worldmodel_answer_without_states_is_split_but_marked_as_format_failure():
    parsed = parse_response("<think>no states</think><answer>1,2,3 || 4,1,2</answer>", mode="add_worldmodel")
    assert parsed.actions == ["1,2,3", "4,1,2"] and not parsed.format_ok


def test_answer_only_mode_without_think():
    parsed = parse_response("<answer>Down</answer>", enable_think=False)
    assert parsed.format_ok and parsed.actions == ["Down"] and parsed.normalized == "<answer>Down</answer>"


def test_only_separators_give_no_actions():
    assert parse_response("<think></think><answer>|| || ||</answer>").actions == []


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.characters(), max_size=400),
       mode=st.sampled_from(["base", "add_worldmodel"]), think=st.booleans())
def test_parse_never_raises_and_respects_action_limit(text, mode, think):
    for candidate in (text, "<think>" + text, f"<think>{text}</think><answer>{text}</answer>"):
        parsed = parse_response(candidate, mode=mode, max_actions=5, enable_think=think)
        assert len(parsed.actions) <= 5
        assert all(a and a == a.strip() for a in parsed.actions)

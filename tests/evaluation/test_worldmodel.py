"""World-model text utilities on constructed responses: extraction, substitution, accuracy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SPA_agent.rollout.turns import EnvRecord, Observation, Turn, as_entry
from SPA_agent.selfplay.worldmodel import (
    extract_states,
    parse_state,
    state_accuracy,
    substitute_states,
    turn_accuracy,
    worldmodel_accuracy,
)

SOKOBAN_S0 = "######\n######\n#O####\n#XP###\n#__###\n######\n" \
    "Player (P) is at (3,2); box (X) is at (3,1); target (O) is at (2,1)."
SOKOBAN_S1 = "######\n######\n#O####\n#X_###\n#_P###\n######\n" \
    "Player (P) is at (4,2); box (X) is at (3,1); target (O) is at (2,1)."
SUDOKU_S0 = "| 3 2 4 1 | . 4 . . | 2 . 3 . | 4 3 . 2 \nEmpty positions to be filled are at (2,1), (2,3)."


def response(obs: str, pred: str, answer: str = "Down") -> str:
    return f"<think> <observation>{obs}</observation> go <prediction>{pred}</prediction></think><answer>{answer}</answer>"


def test_extract_states_finds_all_blocks_in_order():
    text = response("a", "b") + "<observation>c</observation>"
    assert extract_states(text) == (["a", "c"], ["b"])
    assert extract_states("<think>no tags</think><answer>Up</answer>") == ([], [])


def test_substitution_replaces_every_block_and_keeps_backslashes():
    state = r"a\1b\g<0>\\n"  # would be mangled by a replacement template
    sub = substitute_states(response("x", "y") + "<prediction>z</prediction>", state, "NEXT")
    assert sub.text == (f"<think> <observation>{state}</observation> go <prediction>NEXT</prediction></think>"
                        "<answer>Down</answer><prediction>NEXT</prediction>")
    assert (sub.num_observations, sub.num_predictions, sub.has_states) == (1, 2, True)


def test_substitution_leaves_untagged_response_unchanged():
    raw = "<think>I move</think><answer>Up</answer>"
    sub = substitute_states(raw, "S0", "S1")
    assert sub.text == raw and not sub.has_states


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="<>")), st.text(alphabet="\\$&#_O1g0 \n"))
def test_substitution_writes_states_verbatim(obs, state):
    sub = substitute_states(obs + response(obs, obs), state, state)
    assert extract_states(sub.text) == ([state], [state])


def test_parse_grid_and_sudoku_states():
    grid = parse_state(SOKOBAN_S0)
    assert grid.cells[3] == tuple("#XP###") and len(grid.cells) == 6
    assert grid.coords.startswith("Player (P) is at (3,2)")
    board = parse_state(SUDOKU_S0)
    assert board.cells == (("3", "2", "4", "1"), (".", "4", ".", "."), ("2", ".", "3", "."), ("4", "3", ".", "2"))
    assert board.coords == "Empty positions to be filled are at (2,1), (2,3)."
    assert parse_state("____\n_OOP\nGO__\nO___").coords == ""


def test_state_accuracy_exact_cell_and_coords():
    assert state_accuracy(SOKOBAN_S0, SOKOBAN_S0) == {"exact": 1.0, "cell": 1.0, "coords": 1.0}
    # Surrounding whitespace and blank lines do not matter for exact match.
    assert state_accuracy("\n" + SOKOBAN_S0.replace("\n", " \n") + "\n\n", SOKOBAN_S0)["exact"] == 1.0
    # Two of 36 cells differ (player moved), coordinate sentence differs.
    acc = state_accuracy(SOKOBAN_S1, SOKOBAN_S0)
    assert acc == {"exact": 0.0, "cell": pytest.approx(34 / 36), "coords": 0.0}
    # Grid only (coordinate sentence missing): cells all right, coords wrong.
    grid_only = SOKOBAN_S0.rsplit("\n", 1)[0]
    assert state_accuracy(grid_only, SOKOBAN_S0) == {"exact": 0.0, "cell": 1.0, "coords": 0.0}
    # Truncated grid: missing cells count as wrong.
    assert state_accuracy("######\n######\n#O", SOKOBAN_S0)["cell"] == pytest.approx(14 / 36)
    # Plain text render: no coordinate sentence to compare.
    assert state_accuracy("____\n_OOP", "____\n_OOP\nGO__\nO___") == {"exact": 0.0, "cell": 0.5, "coords": None}


def test_sudoku_cell_accuracy_counts_board_digits():
    imagined = SUDOKU_S0.replace("| 3 2 4 1", "| 3 2 1 4")
    acc = state_accuracy(imagined, SUDOKU_S0)
    assert acc == {"exact": 0.0, "cell": pytest.approx(14 / 16), "coords": 1.0}


def test_turn_accuracy_uses_first_blocks_and_zero_for_missing_one():
    scores = turn_accuracy(response(SOKOBAN_S0, SOKOBAN_S0), SOKOBAN_S0, SOKOBAN_S1)
    assert scores["observation_exact"] == 1.0 and scores["prediction_exact"] == 0.0
    assert scores["prediction_cell"] == pytest.approx(34 / 36)
    only_obs = f"<think><observation>{SOKOBAN_S0}</observation></think><answer>Up</answer>"
    scores = turn_accuracy(only_obs, SOKOBAN_S0, SOKOBAN_S1)
    assert scores["prediction_exact"] == 0.0 and scores["prediction_cell"] == 0.0
    assert turn_accuracy("<answer>Up</answer>", SOKOBAN_S0, SOKOBAN_S1) is None


def test_worldmodel_accuracy_aggregates_per_tag():
    def turn(state: str, raw: str) -> dict:
        return as_entry(Turn(state, 10, actions=["Down"], reward=0.0, info={}, llm_response=raw,
                             llm_raw_response=raw, parsed={"format_ok": True}, response_ids=[1]))

    history = [
        turn(SOKOBAN_S0, response(SOKOBAN_S0, SOKOBAN_S1)),
        turn(SOKOBAN_S1, "<answer>Up</answer>"),
        as_entry(Observation(SOKOBAN_S1, 8)),
    ]
    record = EnvRecord(env_id=0, group_id=0, tag="SimpleSokoban", seed=0, penalty=0.0, metrics={}, history=history)
    metrics = worldmodel_accuracy([record], prefix="val-env/")
    assert metrics["val-env/SimpleSokoban/worldmodel/format_rate"] == 0.5
    assert metrics["val-env/SimpleSokoban/worldmodel/observation_exact"] == 1.0
    assert metrics["val-env/SimpleSokoban/worldmodel/prediction_coords"] == 1.0

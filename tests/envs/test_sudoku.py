"""Sudoku: spec §3.4 vectors, move parsing, rules, clue cells, rewards and bad input."""

import pytest

from SPA_agent.envs import SudokuEnv, make_env
from SPA_agent.envs.sudoku import candidates, count_solutions, parse_move

SPEC_PUZZLES = {  # spec §3.4: seed -> (text_with_coordinates render, solution rows)
    123: (
        (
            "| 3 2 4 1 | . 4 . . | 2 . 3 . | 4 3 . 2 \n"
            "Empty positions to be filled are at (2,1), (2,3), (2,4), (3,2), (3,4), (4,3)."
        ),
        ["3241", "1423", "2134", "4312"],
    ),
    10000: (
        (
            "| 4 . . 3 | 3 1 . . | . 4 . 2 | 2 3 4 1 \n"
            "Empty positions to be filled are at (1,2), (1,3), (2,3), (2,4), (3,1), (3,3)."
        ),
        ["4213", "3124", "1432", "2341"],
    ),
}


@pytest.mark.parametrize("seed", sorted(SPEC_PUZZLES))
def test_reset_reproduces_spec_vectors(seed):
    env = make_env("sudoku", {"render_mode": "text_with_coordinates"})
    assert env.reset(seed=seed) == SPEC_PUZZLES[seed][0]
    assert ["".join(map(str, row)) for row in env.solution] == SPEC_PUZZLES[seed][1]


def test_plain_render_has_no_coordinate_line():
    assert SudokuEnv().reset(seed=123) == "| 3 2 4 1 | . 4 . . | 2 . 3 . | 4 3 . 2 "


@pytest.mark.parametrize("difficulty,clues", [("easy", 10), ("medium", 9), ("hard", 6)])
def test_puzzles_have_the_clue_count_and_a_unique_solution(difficulty, clues):
    env = make_env("sudoku", {"difficulty": difficulty})
    for seed in range(5):
        env.reset(seed=seed)
        assert sum(v != 0 for row in env.board for v in row) == clues
        assert count_solutions([row[:] for row in env.board]) == 1


@pytest.mark.parametrize(
    "text,move",
    [
        ("2,1,1", (1, 0, 1)),
        (" 2, 1, 1 ", (1, 0, 1)),
        ("2 1 1", (1, 0, 1)),
        ("place 3 at row 2 col 1", (1, 0, 3)),
        ("Row 4 Col 3 value 1", (3, 2, 1)),
        ("5,1,1", None),
        ("1,1,0", None),
        ("1,1", None),
        ("a,b,c", None),
        ("", None),
        ("row col", None),
        ("-1,2,3", None),
        ("02,001,1", (1, 0, 1)),
        ("place ² 3 at row 2 col 1", (1, 0, 3)),
    ],
)
def test_parse_move(text, move):
    assert parse_move(text) == move


# Issue 12: `str.isdigit` is true for these, but they are not ASCII digits ('²', '①' crash `int`;
# Arabic-Indic and fullwidth digits are read by `int`), and `int` refuses more than 4300 digits.
NON_ASCII_MOVES = [
    "²,1,1", "2,①,1", "2,1,٣", "２,1,1", "place ³ at row 2 col 1", "row ² col 1 3", "9" * 5000 + ",1,1",
]


@pytest.mark.parametrize("action", NON_ASCII_MOVES)
def test_moves_that_are_not_ascii_numbers_are_invalid_actions(action):
    env = SudokuEnv()
    before = env.reset(seed=123)
    obs, reward, done, info = env.step(action)
    assert parse_move(action) is None
    assert obs == before and reward == 0.0 and not done
    assert info == {"success": False, "action_is_valid": False, "action_is_effective": False}


def test_valid_move_fills_cell():
    env = SudokuEnv()
    env.reset(seed=123)
    obs, reward, done, info = env.step("2,1,1")
    assert obs.startswith("| 3 2 4 1 | 1 4 . . ") and reward == 0.0 and not done
    assert info == {"success": False, "action_is_valid": True, "action_is_effective": True}


def test_rule_violation_is_valid_but_not_effective():
    env = SudokuEnv()
    before = env.reset(seed=123)
    obs, reward, _, info = env.step("2,1,4")  # 4 is already in row 2
    assert obs == before and reward == 0.0 and info["action_is_valid"] and not info["action_is_effective"]


@pytest.mark.parametrize("action", ["1,1,3", "1,1,2", "9,9,9", "hello"])
def test_clue_cells_and_garbage_are_invalid(action):
    env = SudokuEnv()
    before = env.reset(seed=123)
    obs, reward, _, info = env.step(action)
    assert obs == before and reward == 0.0 and not info["action_is_valid"] and not info["action_is_effective"]
    assert env.current_step == 1


def test_filling_the_solution_gives_reward_one_once():
    env = SudokuEnv()
    env.reset(seed=10000)
    empties = [(r, c) for r in range(4) for c in range(4) if env.board[r][c] == 0]
    rewards = []
    for r, c in empties:
        _, reward, done, info = env.step(f"{r + 1},{c + 1},{env.solution[r][c]}")
        rewards.append(reward)
    assert rewards == [0.0] * (len(empties) - 1) + [1.0] and done and info["success"]


def test_agent_filled_cells_can_be_overwritten():
    env = make_env("sudoku", {"difficulty": "hard"})
    env.reset(seed=0)
    r, c, options = next(
        (r, c, candidates(env.board, r, c))
        for r in range(4)
        for c in range(4)
        if env.board[r][c] == 0 and len(candidates(env.board, r, c)) >= 2
    )
    assert env.step(f"{r + 1},{c + 1},{options[0]}")[3]["action_is_effective"]
    _, _, _, info = env.step(f"{r + 1},{c + 1},{options[1]}")
    assert info["action_is_valid"] and info["action_is_effective"] and env.board[r][c] == options[1]


def test_episode_ends_at_max_steps():
    env = make_env("sudoku", {"max_steps": 3})
    env.reset(seed=123)
    assert [env.step("x")[2] for _ in range(3)] == [False, False, True]


def test_all_actions_are_every_move():
    actions = SudokuEnv().get_all_actions()
    assert len(actions) == 64 and actions[0] == "1,1,1" and actions[-1] == "4,4,4"


@pytest.mark.parametrize(
    "config,field",
    [
        ({"board_size": 2}, "board_size"),
        ({"board_size": 9}, "board_size"),
        ({"difficulty": "expert"}, "difficulty"),
        ({"render_mode": "image"}, "render_mode"),
        ({"max_steps": -1}, "max_steps"),
    ],
)
def test_bad_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        make_env("sudoku", config)

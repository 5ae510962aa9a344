"""Sokoban: spec §3.2 vectors, renders, step semantics, fast generator == plain reference generator."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
from sokoban_reference import generate_room as reference_room

from SPA_agent.envs import SokobanEnv, SokobanEnvConfig, make_env
from SPA_agent.envs.base import fallback_seed
from SPA_agent.envs.sokoban_room import (
    BOX,
    FLOOR,
    PLAYER,
    TARGET,
    RoomGenerationError,
    generate_room,
    place_boxes_and_player,
    reverse_play,
    topology,
)

# Spec §3.2 (computed there with PYTHONHASHSEED=10000; none of these seeds needs the fallback seed).
SPEC_ROOMS = {
    123: "######/######/#O####/#XP###/#__###/######",
    124: "######/######/#O####/#X_###/#P####/######",
    125: "######/#__O_#/#____#/#_X__#/#_P###/######",
    10000: "######/#O####/#__###/#X_###/#_P_##/######",
    10001: "######/#____#/#_OX_#/#_#P_#/######/######",
}
FIXTURE = Path(__file__).parents[1] / "data" / "sokoban_reference_rooms.json"
SYMBOLS = {"#": 0, "_": 1, "O": 2, "√": 3, "X": 4, "P": 5, "S": 6}


@pytest.mark.parametrize("seed", sorted(SPEC_ROOMS))
def test_reset_reproduces_spec_vectors(seed):
    assert SokobanEnv().reset(seed=seed) == SPEC_ROOMS[seed].replace("/", "\n")


def test_spec_vector_seeds_do_not_need_the_fallback_seed():
    for seed in SPEC_ROOMS:
        env = SokobanEnv()
        env.reset(seed=seed)
        assert env.seed == seed


def test_coordinates_render_of_seed_123():
    env = make_env("sokoban", {"render_mode": "text_with_coordinates"})
    assert env.reset(seed=123) == (
        SPEC_ROOMS[123].replace("/", "\n")
        + "\nPlayer (P) is at (3,2); box (X) is at (3,1); target (O) is at (2,1)."
    )


def _rooms(case):
    data = json.loads(FIXTURE.read_text())[case]
    return data, {int(seed): room for seed, room in data["rooms"].items()}


@pytest.mark.parametrize("case", ["6x6_1box", "6x6_2box_depth30", "10x10_2box"])
def test_fast_generator_matches_reference_fixture(case):
    data, rooms = _rooms(case)
    rows, cols = data["dim"]
    for seed, expected in rooms.items():
        random.seed(seed)
        np.random.seed(seed)
        try:
            room = generate_room(
                (rows, cols), int(1.7 * (rows + cols)), data["num_boxes"], data["search_depth"]
            )
        except RoomGenerationError:
            assert expected is None, seed
            continue
        assert expected is not None, seed
        assert room.structure.tolist() == expected[0] and room.state.tolist() == expected[1], seed


@pytest.mark.parametrize(
    "dim,num_boxes,seeds", [((6, 6), 1, range(500, 530)), ((10, 10), 2, range(500, 504))]
)
def test_fast_generator_matches_live_reference(dim, num_boxes, seeds):
    for seed in seeds:
        expected = reference_room(seed, dim, num_boxes)
        random.seed(seed)
        np.random.seed(seed)
        if expected is None:
            with pytest.raises(RoomGenerationError):
                generate_room(dim, int(1.7 * sum(dim)), num_boxes)
            continue
        room = generate_room(dim, int(1.7 * sum(dim)), num_boxes)
        assert np.array_equal(room.structure, expected[0]) and np.array_equal(room.state, expected[1]), seed


# Seeds where gym-sokoban 0.0.6 (every pull counted as a box swap) gives another room than spec §3.2:
# 10003 from issue 12, and the four validation puzzles (seeds 123-250) it changes.
SWAP_COUNT_SEEDS = [10003, 141, 148, 159, 239]


@pytest.mark.parametrize("seed", SWAP_COUNT_SEEDS)
def test_env_rooms_match_reference_where_gym_sokoban_differs(seed):
    env = SokobanEnv()
    env.reset(seed=seed)
    structure, state = reference_room(seed, (6, 6), 1)
    assert env.seed == seed
    assert np.array_equal(env.room_fixed, structure) and np.array_equal(env.room_state, state)


def test_seed_10003_puts_the_player_where_the_original_generator_does():
    env = make_env("sokoban", {"render_mode": "text_with_coordinates"})
    assert env.reset(seed=10003).endswith("Player (P) is at (3,1); box (X) is at (3,2); target (O) is at (2,3).")


@pytest.mark.parametrize("seed", range(20))
def test_one_box_search_counts_a_single_swap(seed):
    """With one box every pull after the first moves the same box, so the best score is its displacement."""
    random.seed(seed)
    np.random.seed(seed)
    room = place_boxes_and_player(topology((6, 6), 0.35, 20), 1)
    structure = bytes(FLOOR if v == PLAYER else v for v in room)
    best, score, boxes = reverse_play(bytearray(BOX if v == TARGET else v for v in room), structure, 6, 300)
    (target,) = [i for i, v in enumerate(structure) if v == TARGET]
    (box,) = boxes
    assert score == abs(box // 6 - target // 6) + abs(box % 6 - target % 6)


def test_seed_without_room_falls_back_to_derived_seed():
    _, rooms = _rooms("6x6_2box_depth30")
    seed = next(s for s, room in rooms.items() if room is None)
    env = make_env("sokoban", {"num_boxes": 2, "search_depth": 30})
    first = env.reset(seed=seed)
    assert env.seed != seed and env.seed in _fallback_chain(seed)
    assert env.reset(seed=seed) == first


def _fallback_chain(seed, length=5):
    chain = []
    for _ in range(length):
        seed = fallback_seed(seed)
        chain.append(seed)
    return chain


def _env_with(grid, **config):
    """An env whose room is `grid` (rows of spec symbols; `S`/`√` put a target under the player/box)."""
    env = SokobanEnv(SokobanEnvConfig(**config))
    state = np.array([[SYMBOLS[ch] for ch in row] for row in grid.split("/")])
    env.room_fixed = np.where(np.isin(state, (2, 3, 6)), 2, np.where(state == 0, 0, 1))
    env.room_state = np.where(state == 6, 5, state)
    env.num_env_steps = 0
    return env


def test_push_moves_box_and_player():
    env = _env_with("######/#____#/#_X__#/#_P__#/#____#/######")
    obs, reward, done, info = env.step("up")
    assert obs.split("\n")[1:4] == ["#_X__#", "#_P__#", "#____#"]
    assert reward == pytest.approx(-0.1) and not done
    assert info == {"success": False, "action_is_valid": True, "action_is_effective": True}


@pytest.mark.parametrize("grid", ["#####/#X__#/#P__#/#___#/#####", "#####/#X__#/#X__#/#P__#/#####"])
def test_push_into_wall_or_box_is_not_effective(grid):
    env = _env_with(grid, num_boxes=2)
    obs, reward, _, info = env.step("Up")
    assert obs == grid.replace("/", "\n")
    assert reward == -0.1 and info["action_is_effective"] is False and info["action_is_valid"] is True


def test_pushing_box_onto_target_solves_with_exact_reward():
    env = _env_with("######/#_O__#/#_X__#/#_P__#/######")
    obs, reward, done, info = env.step(1)
    assert obs == "######\n#_√__#\n#_P__#\n#____#\n######"
    assert reward == -0.1 + 1.0 + 10.0 and done and info["success"]


def test_box_off_target_costs_one_and_player_on_target_renders_s():
    env = _env_with("######/#____#/#_√__#/#_P__#/#_OX_#/######", num_boxes=2)
    _, reward, done, info = env.step(1)
    assert reward == -0.1 - 1.0 and not done and not info["success"]
    env = _env_with("######/#____#/#_P__#/#_O__#/#____#/######")
    assert env.step("Down")[0].split("\n")[3] == "#_S__#"


def test_episode_ends_at_max_steps():
    env = _env_with("######/#X_O_#/#____#/#__P_#/######", max_steps=3)
    dones = [env.step("Right")[2] for _ in range(3)]
    assert dones == [False, False, True]


def test_unknown_action_is_invalid_not_a_crash():
    env = SokobanEnv()
    before = env.reset(seed=123)
    for action in ("Jump", 0, 7, None, 2.5):
        obs, reward, _, info = env.step(action)
        assert (
            obs == before
            and reward == -0.1
            and not info["action_is_valid"]
            and not info["action_is_effective"]
        )


def test_action_vocabulary_relabels_fixed_moves():
    env = make_env("sokoban", {"action_lookup": {1: "Left", 2: "Right", 3: "Up", 4: "Down"}})
    plain = SokobanEnv()
    plain.reset(seed=125)
    env.reset(seed=125)
    assert env.get_all_actions() == ["Left", "Right", "Up", "Down"]
    assert env.step("Left")[0] == plain.step("Up")[0]


def test_grid_vocabulary_changes_symbols_and_sentence():
    lookup = {0: "W", 1: "*", 2: "@", 3: "✓", 4: "B", 5: "A", 6: "D"}
    env = make_env("sokoban", {"grid_lookup": lookup, "render_mode": "text_with_coordinates"})
    obs = env.reset(seed=123)
    assert obs.split("\n")[3] == "WBAWWW"
    assert obs.endswith("Player (A) is at (3,2); box (B) is at (3,1); target (@) is at (2,1).")


def test_harder_sokoban_has_two_boxes():
    env = make_env("sokoban", {"dim_x": 10, "dim_y": 10, "num_boxes": 2})
    obs = env.reset(seed=7)
    assert len(obs.split("\n")) == 10 and obs.count("X") == 2 and obs.count("O") + obs.count("S") == 2


@pytest.mark.parametrize(
    "config,field",
    [
        ({"num_boxes": 0}, "num_boxes"),
        ({"dim_x": 2, "dim_y": 2}, "dim_x"),
        ({"num_boxes": 15}, "num_boxes"),
        ({"render_mode": "rgb"}, "render_mode"),
        ({"action_lookup": {1: "Up"}}, "action_lookup"),
        ({"grid_lookup": {0: "#"}}, "grid_lookup"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_bad_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        make_env("sokoban", config)


def test_coordinates_report_covered_targets_as_in_the_prompt_example():
    env = _env_with("######/#_O__#/#_X__#/#_P__#/#____#/######", render_mode="text_with_coordinates")
    obs = env.step("Up")[0]
    assert obs == (
        "######\n#_√__#\n#_P__#\n#____#\n#____#\n######\n"
        "Player (P) is at (2,2); box (X) is at (1,2); target (O) is at (1,2)."
    )
    env = _env_with("#####/#_S_#/#_X_#/#___#/#####", render_mode="text_with_coordinates")
    assert env.render().endswith("Player (P) is at (1,2); box (X) is at (2,2); target (O) is at (1,2).")

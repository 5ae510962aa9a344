"""FrozenLake: spec §3.3 vectors, renders, slipping statistics, rewards and bad input."""

import pytest

from SPA_agent.envs import FrozenLakeEnv, make_env

SPEC_MAPS = {  # spec §3.3: seed -> (map rows, text render)
    123: (["FFFF", "FHHS", "GHFF", "HFFF"], "____/_OOP/GO__/O___"),
    10000: (["FFFF", "FFFF", "FFFH", "GSFF"], "____/____/___O/GP__"),
}
DELTAS = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
CLOCKWISE = ["Up", "Right", "Down", "Left"]


@pytest.mark.parametrize("seed", sorted(SPEC_MAPS))
def test_reset_reproduces_spec_vectors(seed):
    env = FrozenLakeEnv()
    assert env.reset(seed=seed) == SPEC_MAPS[seed][1].replace("/", "\n")
    assert env.desc == SPEC_MAPS[seed][0]


def test_coordinates_render_lists_player_holes_and_goal():
    env = make_env("frozen_lake", {"render_mode": "text_with_coordinates"})
    assert env.reset(seed=10000) == (
        "____\n____\n___O\nGP__\nPlayer (P) is at (3,1); hole (O) is at (2,3); goal (G) is at (3,0)."
    )


def test_slips_are_one_third_each_way():
    """Over many steps the executed move is the intended one or either perpendicular, 1/3 each."""
    counts = {"intended": 0, "clockwise": 0, "counterclockwise": 0}
    env = make_env("frozen_lake", {"size": 6, "p": 1.0})
    for seed in range(300):
        env.reset(seed=seed)
        for i in range(12):
            action = CLOCKWISE[(seed + i) % 4]
            (r, c), k = env.player, CLOCKWISE.index(action)
            outcomes = {
                "intended": action,
                "clockwise": CLOCKWISE[(k + 1) % 4],
                "counterclockwise": CLOCKWISE[(k - 1) % 4],
            }
            targets = {name: (r + DELTAS[a][0], c + DELTAS[a][1]) for name, a in outcomes.items()}
            inside = all(0 <= tr < 6 and 0 <= tc < 6 for tr, tc in targets.values())
            _, _, done, _ = env.step(action)
            if inside:
                (name,) = [n for n, cell in targets.items() if cell == env.player]
                counts[name] += 1
            if done:
                break
    total = sum(counts.values())
    assert total > 1500
    for name, n in counts.items():
        assert abs(n / total - 1 / 3) < 0.04, (name, counts)


def test_not_slippery_moves_as_told():
    env = make_env("frozen_lake", {"is_slippery": False})
    env.reset(seed=10000)
    obs, reward, done, info = env.step("Right")
    assert obs == "____\n____\n___O\nG_P_" and reward == 0.0 and not done and info["action_is_effective"]
    assert env.step("Left")[0] == "____\n____\n___O\nGP__"
    obs, reward, done, info = env.step("Left")
    assert obs == "____\n____\n___O\n√___" and reward == 1.0 and done and info["success"]


def test_falling_into_a_hole_ends_without_reward():
    env = make_env("frozen_lake", {"is_slippery": False, "render_mode": "text_with_coordinates"})
    env.reset(seed=123)
    obs, reward, done, info = env.step(1)  # id 1 = Left, into the hole at (1,2)
    assert obs.split("\n")[1] == "_OX_" and reward == 0.0 and done and not info["success"]
    assert obs.endswith(
        "Player (P) is at (1,2); hole (O) is at (1,1); hole (O) is at (1,2); "
        "hole (O) is at (2,1); hole (O) is at (3,0); goal (G) is at (2,0)."
    )


def test_unknown_action_is_invalid():
    env = FrozenLakeEnv()
    before = env.reset(seed=123)
    obs, reward, done, info = env.step("Jump")
    assert obs == before and reward == 0.0 and not done and not info["action_is_valid"]


def test_map_seed_fixes_the_map():
    env = make_env("frozen_lake", {"map_seed": 123})
    env.reset(seed=5)
    assert env.desc == SPEC_MAPS[123][0]


def test_six_by_six_map():
    env = make_env("frozen_lake", {"size": 6})
    rows = env.reset(seed=1).split("\n")
    assert len(rows) == 6 and all(len(row) == 6 for row in rows)


@pytest.mark.parametrize(
    "config,field",
    [
        ({"p": 0.0}, "p"),
        ({"p": 1.5}, "p"),
        ({"size": 1}, "size"),
        ({"render_mode": "image"}, "render_mode"),
        ({"is_slippery": "yes"}, "is_slippery"),
    ],
)
def test_bad_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        make_env("frozen_lake", config)

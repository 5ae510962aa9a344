"""Stage 1 with `generator=solver` (issue 43): the same data and card as the random-action data, with
`action_source: solver`, shortest-plan trajectories and the success the 10-action budget allows."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from SPA_agent.config import compose
from SPA_agent.envs import make_env
from SPA_agent.generators.solver import plan_actions
from SPA_agent.selfplay.generate import DATA_FILES, SFT_SCHEMA, generate, prepare_data_gen_config
from SPA_agent.selfplay.worldmodel import extract_states


def solver_config(out_dir, *overrides, num_batches=2):
    cfg = prepare_data_gen_config(compose("_2_sokoban", ["model=tiny", "generator=solver", *overrides]), "_2_sokoban")
    OmegaConf.update(cfg, "data_gen.num_batches", num_batches)
    OmegaConf.update(cfg, "data_gen.output_dir", str(out_dir))
    return cfg


def fresh_env(cfg, seed):
    env_cfg = cfg.custom_envs.SimpleSokoban
    env = make_env(env_cfg.env_type, OmegaConf.to_container(env_cfg.env_config, resolve=True))
    env.reset(seed=seed, mode="train")
    return env


def test_solver_data_end_to_end(tmp_path):
    cfg = solver_config(tmp_path)
    card = generate(cfg)
    assert card["generator"] == "solver" and card["action_source"] == "solver"
    assert card["success_rate"] == 1.0 and card["num_trajectories"] == 2 * 4 * 2
    assert card["generator_stats"] == {"fallback_turns": 0, "solved_turns": card["num_rows"]}
    assert set(card["self_belief_accuracy"].values()) == {1.0}  # the solver's own states are the true ones
    assert card["num_rows_passing_format_filter"] == card["num_rows"]
    for name in DATA_FILES:
        assert pq.read_schema(tmp_path / name).equals(SFT_SCHEMA)
    trajectories = {t["trajectory_id"]: t for t in map(json.loads, (tmp_path / "raw_trajectories.jsonl").open())}
    for trajectory in trajectories.values():
        env = fresh_env(cfg, trajectory["seed"])
        assert [a for turn in trajectory["actions"] for a in turn] == plan_actions(env)  # one shortest plan
        assert all(len(turn) <= 5 for turn in trajectory["actions"])
    for row in (row for name in DATA_FILES for row in pq.read_table(tmp_path / name).to_pylist()):
        trajectory = trajectories[row["trajectory_id"]]
        env = fresh_env(cfg, row["seed"])
        for action in (a for turn in trajectory["actions"][: row["turn"]] for a in turn):
            env.step(action)
        assert extract_states(row["response"])[0] == [env.render()]


def test_success_is_the_share_of_puzzles_whose_shortest_plan_fits_the_budget(tmp_path):
    cfg = solver_config(tmp_path, "seed.train=10012", num_batches=1)  # seed 10014 needs 11 moves, the budget is 10
    lengths = [len(plan_actions(fresh_env(cfg, seed))) for seed in range(10012, 10016)]
    assert lengths[2] == 11 and max(lengths[:2] + lengths[3:]) <= cfg.custom_envs.SimpleSokoban.max_actions_per_traj
    assert generate(cfg)["success_rate"] == 0.75


def test_unsupported_env_is_a_one_line_error(tmp_path, call_entry):
    with pytest.raises(ValueError, match=r"generator=solver cannot play env type\(s\) \['frozen_lake'\]"):
        prepare_data_gen_config(compose("_3_frozen_lake", ["model=tiny", "generator=solver"]), "_3_frozen_lake")
    # the entry point in this process (tests/datagen/test_generate_sft_data.py starts it as a process)
    from SPA_agent import generate_sft_data

    code, err = call_entry(generate_sft_data, ["--config-name", "_10_sudoku", "model=tiny", "generator=solver",
                                               f"output_root={tmp_path}"])
    assert code == 2 and err.strip().splitlines() == [
        "error: generator=solver cannot play env type(s) ['sudoku']: it plays ['sokoban'] only (docs/generators.md)"]
    assert not any(tmp_path.iterdir())

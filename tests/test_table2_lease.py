"""Issue 43's Table 2 lease (docs/results/smollm2_table2): its arms are the rows' recipe, three seeds each, in the
priority order the lease runs them, and every arm's PPO config composes for SmolLM2 and passes the PPO checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from SPA_agent.config import compose
from SPA_agent.trainer.config_checks import check_config

HERE = Path(__file__).resolve().parents[1] / "docs" / "results" / "smollm2_table2"
#: what each start of benchmarks/smollm2_sweep.sh makes a row: (prompt mode, render mode, experiment override)
ROWS = {"wm": ("spa", "add_worldmodel", "text_with_coordinates"), "nowm": ("format", "base", "text_with_coordinates"),
        "base": ("vanilla", "base", "text")}
#: the settings job.sh gives every sweep (benchmarks/smollm2_sweep.sh's PPO array)
SWEEP = ["ctx_manager.mode=base", "trainer.total_training_steps=300", "trainer.test_freq=25", "trainer.save_freq=0",
         "es_manager.val.group_size=4"]
#: overrides that may differ between arms: the prompts, the Vanilla RL render and the seed
PER_ARM = ("ctx_manager.mode", "experiment", "trainer.seed", "generator.seed")


def arms() -> list[tuple[str, str, list[str]]]:
    lines = [line.split() for line in (HERE / "arms.txt").read_text().splitlines() if line and line[0] != "#"]
    return [(name, start, overrides) for name, start, *overrides in lines]


def test_arms_are_three_seeds_of_each_row_in_the_lease_priority_order():
    names = [name for name, _, _ in arms()]
    assert names == ["spa_s0", "format_s0", "vanilla_s0", "spa_s1", "spa_s2", "format_s1", "format_s2",
                     "vanilla_s1", "vanilla_s2"]
    for name, start, overrides in arms():
        row, seed = re.fullmatch(r"(\w+)_s(\d)", name).groups()
        assert ROWS[start][0] == row
        settings = dict(o.split("=", 1) for o in overrides)
        assert settings["trainer.seed"] == settings["generator.seed"] == seed  # the run's seed: init and sampling
        assert settings["ctx_manager.mode"] == ROWS[start][1]
        assert settings.get("experiment") == ("vanilla_rl" if start == "base" else None)


def test_arms_share_one_ppo_recipe():
    recipes = {tuple(sorted(o for o in overrides if o.split("=")[0] not in PER_ARM)) for _, _, overrides in arms()}
    assert recipes == {("actor_rollout_ref.actor.optim.lr=1e-5", "critic.optim.lr=1e-4")}


@pytest.mark.parametrize("name, start, overrides", arms(), ids=[a[0] for a in arms()])
def test_each_arm_composes_for_smollm2_and_passes_the_ppo_checks(name, start, overrides):
    cfg = compose("_2_sokoban", ["model=smollm2-135m", *SWEEP, *overrides])
    check_config(cfg)
    assert (cfg.ctx_manager.mode, cfg.render_mode) == ROWS[start][1:]
    assert cfg.trainer.val_before_train is True  # step 0 validates the starting model: the Base and SFT-only rows
    assert cfg.es_manager.val.env_groups * cfg.es_manager.val.group_size == 512  # 128 puzzles x 4
    assert cfg.generator.seed == cfg.trainer.seed == int(name[-1])

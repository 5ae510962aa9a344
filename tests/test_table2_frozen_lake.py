"""Issue 43's Table 2 on FrozenLake 4x4 (`CONFIG=_3_frozen_lake` of docs/results/smollm2_table2/job.sh and
benchmarks/smollm2_sweep.sh): an unknown CONFIG is one line and exit status 2 before any work; collect.sh prints the
validation success of any env's runs; every row's arm composes on FrozenLake for SmolLM2 and passes the PPO checks;
and the rollouts' length the sweep gives SmolLM2 there holds a response in the SFT's format on every puzzle."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from SPA_agent.config import compose
from SPA_agent.envs import REGISTRY
from SPA_agent.generators.base import Prompt
from SPA_agent.generators.random import RandomGenerator
from SPA_agent.trainer.config_checks import check_config

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "docs" / "results" / "smollm2_table2"
SWEEP = REPO / "benchmarks" / "smollm2_sweep.sh"
#: the repository's python first, as the lease's PATH has it
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
#: the settings job.sh gives every sweep (benchmarks/smollm2_sweep.sh's PPO array)
SWEEP_PPO = ["trainer.total_training_steps=300", "trainer.test_freq=25", "trainer.save_freq=0",
             "es_manager.val.group_size=4"]


def frozen_lake_response_length() -> int:
    """The new tokens a turn smollm2_sweep.sh gives SmolLM2's FrozenLake runs."""
    match = re.search(r"_3_frozen_lake:smollm2-135m \] && PPO\+=\(actor_rollout_ref\.rollout\.response_length=(\d+)\)",
                      SWEEP.read_text())
    assert match, "smollm2_sweep.sh no longer sets FrozenLake's response length for smollm2-135m"
    return int(match[1])


@pytest.mark.parametrize("script", ["sweep", "job"])
def test_an_unknown_config_is_one_line_and_exit_status_2(tmp_path, script):
    if script == "sweep":
        command, env = [str(SWEEP)], {"GPUS": "0", "OUT": str(tmp_path / "out")}
    else:
        command, env = [str(HERE / "job.sh")], {"REPO": str(REPO), "WORK": str(tmp_path)}
    result = subprocess.run(["bash", *command], env={**ENV, **env, "CONFIG": "_3_frozen_pond"}, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "'_3_frozen_pond'" in result.stderr and "_3_frozen_lake" in result.stderr
    assert not list(tmp_path.glob("table2_*")) and not (tmp_path / "out" / "logs").exists()  # no sweep, no stage


def write_run(work: Path, start: str, config: str, arm: str, env: str) -> Path:
    run = work / f"table2_{start}" / "ppo" / config / arm
    run.mkdir(parents=True)
    records = [{"step": 0, f"val-env/{env}/success": 0.125}, {"step": 1, f"train/{env}/success": 0.3},
               {"step": 2, f"val-env/{env}/success": 0.25, f"val-env/{env}/worldmodel/prediction_exact": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "val')
    return run


def test_collect_prints_the_validations_of_frozen_lake_runs_and_names_the_config_beside_others(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    write_run(work, "wm", "_3_frozen_lake", "spa_s0", "FrozenLake")
    collect = lambda: subprocess.run(["bash", str(HERE / "collect.sh")], env={**ENV, "WORK": str(work), "OUT": str(out)},
                                     capture_output=True, text=True, timeout=60)
    result = collect()
    assert result.returncode == 0, result.stderr
    assert "spa_s0 step 2 val 0:0.125 2:0.250" in result.stdout.splitlines()
    with tarfile.open(out / "table2.tgz") as tar:
        assert "table2_wm/ppo/_3_frozen_lake/spa_s0/metrics.jsonl" in tar.getnames()

    write_run(work, "base", "_2_sokoban", "vanilla_s0", "SimpleSokoban")  # a Sokoban job's runs in the same WORK
    lines = collect().stdout.splitlines()
    assert "_3_frozen_lake/spa_s0 step 2 val 0:0.125 2:0.250" in lines
    assert "_2_sokoban/vanilla_s0 step 2 val 0:0.125 2:0.250" in lines


def seed0_arms() -> list[tuple[str, str, list[str]]]:
    lines = [line.split() for line in (HERE / "arms.txt").read_text().splitlines() if line and line[0] != "#"]
    return [(name, start, [o.replace("{data}", "/sweep/data") for o in overrides])  # as smollm2_sweep.sh does
            for name, start, *overrides in lines if name.endswith("_s0")]


@pytest.mark.parametrize("name, start, overrides", seed0_arms(), ids=[a[0] for a in seed0_arms()])
def test_each_row_composes_on_frozen_lake_for_smollm2_and_passes_the_ppo_checks(name, start, overrides):
    length = frozen_lake_response_length()
    cfg = compose("_3_frozen_lake", ["model=smollm2-135m", "ctx_manager.mode=base", *SWEEP_PPO,
                                     f"actor_rollout_ref.rollout.response_length={length}", *overrides])
    check_config(cfg)
    assert cfg.es_manager.train.env_configs.tags == cfg.es_manager.val.env_configs.tags == ["FrozenLake"]
    assert cfg.actor_rollout_ref.rollout.response_length == length
    assert cfg.render_mode == ("text" if start == "base" else "text_with_coordinates")
    assert cfg.ctx_manager.mode == ("add_worldmodel" if start == "wm" else "base")


def test_smollm2s_frozen_lake_turn_holds_a_response_in_the_sft_format_on_every_puzzle():
    """A response as the random-action data writes it (both states, the fixed reasoning, three actions) and the end
    of turn, on every validation puzzle and on the first 50 steps' training puzzles, fits the sweep's length: the
    coordinate sentence names every hole, so the response grows ~24 tokens a hole, 286 on the two maps with 8 holes
    among them (seeds 11118 and 11148), over the preset's 256."""
    from transformers import AutoTokenizer

    from SPA_agent import smollm2
    from SPA_agent.model_cache import DEFAULT_CACHE_DIR, MARKER_FILE

    directory = DEFAULT_CACHE_DIR / f"{smollm2.NAME}-{smollm2.VERSION}"
    if not (directory / MARKER_FILE).is_file():  # converting needs the GGUF file (docs/smollm2.md)
        pytest.skip(f"SmolLM2 is not converted on this machine ({directory})")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    cfg = compose("_3_frozen_lake", ["model=smollm2-135m"])
    tag = cfg.custom_envs.FrozenLake
    env_class, config_class = REGISTRY[tag.env_type]
    env = env_class(config_class(**tag.env_config))
    actions = list(config_class().action_lookup.values())
    generator = RandomGenerator()
    seeds = [*range(cfg.seed.val, cfg.seed.val + 128), *range(cfg.seed.train, cfg.seed.train + 50 * 32)]
    longest = 0
    for seed in seeds:
        state = env.reset(seed=seed)
        earlier = {"role": "assistant", "content": f"<observation>{state}</observation><prediction>{state}</prediction>"}
        text = generator.generate([Prompt([earlier], [], action_space=actions, worldmodel=True)])[0].text
        longest = max(longest, len(tokenizer(text, add_special_tokens=False).input_ids) + 1)  # + end of turn
    assert cfg.actor_rollout_ref.rollout.response_length < longest <= frozen_lake_response_length()

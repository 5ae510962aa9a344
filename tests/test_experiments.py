"""The named experiments (config/experiment/): every one composes with each entry config it applies to and names
a known paper row; the list command shows them; the scripts' settings pick defaults and refuse mismatches; and
one experiment of each kind runs on the tiny model (data, SFT and RL here; evaluation and the baseline through
the pipeline scripts in tests/test_scripts.py)."""

from __future__ import annotations

import math
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from turn_spans import turn_spans

from SPA_agent import experiments
from SPA_agent.config import ENTRY_CONFIGS, compose
from SPA_agent.evaluation.paper_results import PAPER_ROWS
from SPA_agent.selfplay.generate import generate, prepare_data_gen_config
from SPA_agent.selfplay.worldmodel import extract_states
from SPA_agent.trainer.config_checks import check_config

#: the experiments issue 15 asks for
REQUIRED = {
    "vanilla_rl", "state_estimation_rl", "spa", "spa_no_state_estimation", "self_belief_sft", "masked_world_model",
    "random_coordinates", "random_action_data", "random_action_data_sft_1epoch", "spa_sft_1epoch", "easy_to_hard",
    "frozenlake6x6_3b", "generalization_harder_sokoban", "generalization_frozenlake", "spa_grpo", "spa_bilevel_gae",
}
CASES = [(name, config) for name in experiments.names()
         for config in (experiments.load(name).configs or ENTRY_CONFIGS)]
TINY_PPO = ["trainer.device=cpu", "es_manager.train.env_groups=2", "es_manager.train.env_configs.n_groups=[2]",
            "es_manager.val.env_groups=1", "es_manager.val.env_configs.n_groups=[1]", "agent_proxy.max_turn=2",
            "actor_rollout_ref.rollout.response_length=16", "ppo_mini_batch_size=2", "trainer.test_freq=0",
            "trainer.total_training_steps=1"]


def test_every_required_experiment_exists_with_valid_metadata():
    assert REQUIRED <= set(experiments.names())
    kinds = set()
    for name in experiments.names():
        exp = experiments.load(name)
        assert exp.name == name and exp.description and exp.paper in PAPER_ROWS
        assert exp.kind in experiments.KINDS and exp.pipeline in experiments.PIPELINES
        assert set(exp.configs) <= set(ENTRY_CONFIGS)
        kinds.add(exp.kind)
    assert kinds == set(experiments.KINDS)


@pytest.mark.parametrize("name, config_name", CASES)
def test_experiment_composes_and_sets_what_it_says(name, config_name):
    cfg = compose(config_name, ["model=tiny", f"experiment={name}"])
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert cfg.experiment_info.name == name
    for split in ("train", "val"):
        for tag in cfg.es_manager[split].env_configs.tags:
            assert cfg.custom_envs[tag].env_config.render_mode == cfg.render_mode
    check_config(cfg)  # the PPO trainer accepts it (spa_grpo: verl's GRPO, no critic)


def test_render_modes_of_the_baselines_and_spa_rows():
    render = {name: compose("_2_sokoban", [f"experiment={name}"]).render_mode
              for name in ("vanilla_rl", "state_estimation_rl", "spa", "spa_no_state_estimation")}
    assert render == {"vanilla_rl": "text", "state_estimation_rl": "text_with_coordinates",
                      "spa": "text_with_coordinates", "spa_no_state_estimation": "text"}


def test_list_command_shows_every_experiment_with_its_paper_row():
    result = subprocess.run([sys.executable, "-m", "SPA_agent.experiments", "list"], capture_output=True, text=True,
                            check=True)
    for name in experiments.names():
        exp = experiments.load(name)
        (line,) = [row for row in result.stdout.splitlines() if row.startswith(f"| `{name}` |")]
        assert exp.paper in line and exp.description in line and exp.command() in line


@pytest.mark.parametrize("pipeline, render, overrides, expected", [
    ("baseline", "", [], {"EXPERIMENT": "vanilla_rl", "EXP_RENDER_MODE": "text", "EXP_ARGS": "experiment=vanilla_rl"}),
    ("baseline", "text_with_coordinates", [], {"EXPERIMENT": "state_estimation_rl"}),
    ("spa", "", [], {"EXPERIMENT": "spa", "EXP_RENDER_MODE": "text_with_coordinates", "EXP_DATA_SUFFIX": ""}),
    ("spa", "text", [], {"EXPERIMENT": "spa_no_state_estimation", "EXP_RENDER_MODE": "text"}),
    ("spa", "", ["experiment=random_action_data_sft_1epoch"],
     {"EXP_ARGS": "", "EXP_DATA_GENERATOR": "random", "EXP_DATA_SUFFIX": "-random_action",
      "EXP_SFT_SUFFIX": "-random_action_data_sft_1epoch", "EXP_SFT_OVERRIDES": "trainer.total_epochs=1"}),
])
def test_script_settings(pipeline, render, overrides, expected):
    values = experiments.settings(pipeline, "_3_frozen_lake", overrides, render)
    assert {key: values[key] for key in expected} == expected


@pytest.mark.parametrize("args, message", [
    (["baseline", "_2_sokoban", "--", "experiment=spa"], "experiment spa runs with run_spa.sh"),
    (["spa", "_2_sokoban", "--", "experiment=easy_to_hard"], "applies to _3_frozen_lake, not _2_sokoban"),
    (["--render-mode", "text", "spa", "_2_sokoban", "--", "experiment=spa"], "RENDER_MODE=text contradicts"),
    (["spa", "_2_sokoban", "--", "experiment=nope"], "unknown experiment 'nope'"),
    (["spa", "_2_sokoban", "--", "no.such_key=1"], "unknown key 'no.such_key' in no.such_key=1; +no.such_key=1 adds"),
])
def test_settings_errors_are_one_line(args, message, capsys):
    assert experiments.main(["settings", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_self_belief_experiment_keeps_the_models_states(tmp_path):
    """Data variant: stage 1 with experiment=self_belief_sft writes the model's own blocks."""
    cfg = compose("_2_sokoban", ["model=tiny", "experiment=self_belief_sft", "generator=random",
                                 "data_gen.num_batches=1", f"data_gen.output_dir={tmp_path}"])
    card = generate(prepare_data_gen_config(cfg, "_2_sokoban"))
    assert card["state_targets"] == "self_belief"
    first_turns = [r for r in pq.read_table(tmp_path / "wm_train.parquet").to_pylist() if r["turn"] == 0]
    assert first_turns and all(extract_states(r["response"]) == ([""], [""]) for r in first_turns)


@pytest.mark.slow
def test_sft_variant_trains_with_the_experiments_overrides(tmp_path):
    """SFT variant: random-action data and the experiment's single SFT epoch."""
    from sft import in_process

    exp = experiments.load("random_action_data_sft_1epoch")
    cfg = compose("_2_sokoban", ["model=tiny", f"experiment={exp.name}", f"generator={exp.data_generator}",
                                 "data_gen.num_batches=1", f"data_gen.output_dir={tmp_path / 'data'}",
                                 "agent_proxy.max_turn=1", "data_gen.val_fraction=0"])
    generate(prepare_data_gen_config(cfg, "_2_sokoban"))
    in_process.train([
        f"data.train_files={tmp_path / 'data' / 'wm_train.parquet'}", "model.partial_pretrain=tiny",
        f"trainer.default_local_dir={tmp_path / 'sft'}", "data.train_batch_size=8", "trainer.device=cpu",
        "data.max_tokens_per_micro_batch=4096", "data.max_length=4096", "trainer.total_epochs=5",
        *exp.sft_overrides])
    records = [OmegaConf.create(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]  # 8 rows, batch 8: one step per epoch, one epoch
    assert all(math.isfinite(r["train/loss"]) for r in records if "train/loss" in r)


@pytest.mark.slow
def test_rl_variant_runs_bilevel_gae(tmp_path, advantage_batches):
    """RL variant: one PPO step with experiment=spa_bilevel_gae on the tiny model. With γ = λ = 1 inside turns,
    every token of turn k returns G_k = Σ_{j ≥ k} γ_high^(j−k) R_j (R_j: the rewards of turn j), whatever the
    critic says; token-level GAE would return the undiscounted Σ_{j ≥ k} R_j instead."""
    from SPA_agent.runs.metrics_logger import read_metrics
    from SPA_agent.trainer.main_ppo import run

    cfg = compose("_3_frozen_lake", ["model=tiny", "experiment=spa_bilevel_gae", *TINY_PPO,
                                     f"trainer.default_local_dir={tmp_path}"])
    assert cfg.algorithm.bi_level_gae is True
    assert (cfg.algorithm.gamma, cfg.algorithm.lam, cfg.algorithm.high_level_gamma) == (1.0, 1.0, 0.95)
    records = read_metrics(run(cfg) / "metrics.jsonl")
    assert records[-1]["step"] == 1 and math.isfinite(records[-1]["actor/pg_loss"])
    (batch,) = advantage_batches
    t = batch.batch
    discounted_somewhere = False
    for row in range(len(batch)):
        spans = turn_spans(t["response_mask"][row] * t["assistant_mask"][row])
        rewards = [t["token_level_rewards"][row, span].sum().item() for span in spans]
        for k, span in enumerate(spans):
            turn_return = sum(0.95 ** (j - k) * r for j, r in enumerate(rewards[k:], start=k))
            torch.testing.assert_close(t["returns"][row, span], torch.full((len(span),), turn_return), rtol=1e-5,
                                       atol=1e-6)
            discounted_somewhere |= abs(turn_return - sum(rewards[k:])) > 1e-3
    assert discounted_somewhere
    assert OmegaConf.load(tmp_path / "config.yaml").experiment_info.name == "spa_bilevel_gae"

"""End-to-end PPO on the tiny model through the real agent proxy: the three envs, resume, the entry point."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from SPA_agent.evaluation.plots import plot_dir
from SPA_agent.runs import checkpoints
from SPA_agent.runs.dir_lock import DirLock
from SPA_agent.runs.metrics_logger import read_metrics
from SPA_agent.trainer.main_ppo import build_trainer, run

TRAIN_KEYS = (
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/entropy",
    "actor/grad_norm", "critic/vf_loss", "critic/score/mean", "critic/advantages/mean", "critic/returns/mean",
    "critic/values/mean", "critic/vf_explained_var", "rollout/old_log_prob", "rollout/ref_log_prob",
    "rollout/in_group_std", "rollout/chosen_in_group_std", "timing_s/gen", "timing_s/old_log_prob",
    "timing_s/ref", "timing_s/values", "timing_s/update_critic", "timing_s/update_actor", "timing_s/step",
    "timing_s/gc_full",
    "diag/entropy/all", "diag/token_share/other", "diag/kl_ref", "train/diag/distinct_in_group",
    "train/diag/distinct_batch", "train/diag/format_valid", "timing_s/diagnostics",
)
LOSSES = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")


def safe_open_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a saved model directory (model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def _check_run(output: Path, tag: str, steps: list[int]) -> list[dict]:
    """metrics.jsonl has the steps (0 = validation before training), the metric keys and finite losses; the
    last checkpoint loads with from_pretrained."""
    records = read_metrics(output / "metrics.jsonl")
    assert [r["step"] for r in records] == steps
    for record in records:
        if record["step"] == 0:
            assert f"val-env/{tag}/success" in record and f"val-env/{tag}/pass@2" in record
            assert "val-env/diag/distinct_in_group" in record and "val-env/diag/format_valid" in record
            continue
        missing = [k for k in (*TRAIN_KEYS, f"train/{tag}/success") if k not in record]
        assert not missing, missing
        assert all(math.isfinite(record[k]) for k in LOSSES)
    assert (output / checkpoints.LATEST_FILE).read_text().strip() == str(steps[-1])
    actor = AutoModelForCausalLM.from_pretrained(output / f"global_step_{steps[-1]}" / "actor")
    assert actor.config.model_type == "qwen2"
    return records


@pytest.mark.slow
@pytest.mark.parametrize("config_name, tag", [("_3_frozen_lake", "FrozenLake"), ("_10_sudoku", "Sudoku")])
def test_two_step_ppo_run_logs_finite_losses_and_checkpoints(ppo_config, config_name, tag):
    """… trains on policy: the filtered batch (1 group × 2) is one mini-batch, so each update starts at the policy
    whose log-probs the rollout recorded (ratio 1: PPO's KL 0, nothing clipped), and the saved actor and critic
    are not the starting model; and the diagnostics: input dependence at every step with mi_freq=1, the plot."""
    from SPA_agent.model_presets import resolve_model_path

    output = run(ppo_config(config_name, "trainer.diagnostics.mi_freq=1"))
    records = _check_run(output, tag, [0, 1, 2])
    assert f"val-env/{tag}/success" in records[-1]  # validation at the last step
    for record in records[1:]:
        assert abs(record["actor/ppo_kl"]) < 1e-9 and record["actor/pg_clipfrac"] == 0.0
        assert record["actor/grad_norm"] > 0 and record["critic/grad_norm"] > 0
    start = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny")).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(output / "global_step_2" / "actor").state_dict()
    changed = [name for name, weight in start.items() if not torch.equal(weight, trained[name])]
    assert "model.embed_tokens.weight" in changed and "model.norm.weight" in changed
    critic = safe_open_tensors(output / "global_step_2" / "critic")
    assert critic["score.weight"].shape == (1, start["model.norm.weight"].shape[0])
    for record in records[1:]:
        assert record["diag/mi/chance"] == 0.5 and 0 <= record["diag/mi/accuracy"] <= 1  # 2 groups
        assert math.isfinite(record["diag/mi/estimate"])
    assert (output / "diagnostics.png") in plot_dir(output)


@pytest.mark.slow
def test_sokoban_run_resumes_from_saved_step_with_the_same_seeds(ppo_config):
    """Step 1, stop, rerun to step 2: resumes at 1; gradient checkpointing on as in the paper's runs."""
    overrides = ("actor_rollout_ref.model.enable_gradient_checkpointing=True",
                 "critic.model.enable_gradient_checkpointing=True", "trainer.save_freq=1", "trainer.test_freq=0")
    output = run(ppo_config("_2_sokoban", "trainer.total_training_steps=1", *overrides))
    assert checkpoints.saved_steps(output) == [1]
    lock = DirLock(output)  # build_trainer takes it once its checks pass
    try:
        trainer = build_trainer(ppo_config("_2_sokoban", "trainer.total_training_steps=2", *overrides), lock)
        assert trainer.global_step == 1
        trainer.fit()
    finally:
        lock.release()
    records = _check_run(output, "SimpleSokoban", [1, 2])
    # Train seeds are seed.train + env_groups·k + g: the resumed step 2 draws rollout k = 1, not k = 0 again.
    assert [r["rollout/first_seed"] for r in records] == [10000, 10002]
    assert checkpoints.saved_steps(output) == [2]  # max_*_ckpt_to_keep = 1


def test_entry_point_turns_config_mistakes_into_one_line(tmp_path, call_entry):
    """In this process (the run_spa.sh and run_baseline.sh tests start the entry point as a process)."""
    from SPA_agent.trainer import main_ppo

    code, err = call_entry(main_ppo, ["--config-name", "_2_sokoban", "model=tiny", "ppo_mini_batch_size=64",
                                      f"trainer.default_local_dir={tmp_path}"])
    assert code == 2 and "ppo_mini_batch_size" in err and err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.slow
def test_resumed_run_reproduces_the_uninterrupted_run(ppo_config, tmp_path):
    """Interrupt after step 1 and resume: step 2's losses and the final actor equal an uninterrupted run's. The
    resumed run measures input dependence at every step, the other never: diagnostics leave training unchanged."""


    common = ("trainer.save_freq=1", "trainer.test_freq=0")
    straight = run(ppo_config("_2_sokoban", "trainer.total_training_steps=2", *common, "trainer.diagnostics.mi_freq=0",
                              f"trainer.default_local_dir={tmp_path / 'straight'}"))
    resumed_dir = f"trainer.default_local_dir={tmp_path / 'resumed'}"
    common = (*common, "trainer.diagnostics.mi_freq=1")
    run(ppo_config("_2_sokoban", "trainer.total_training_steps=1", *common, resumed_dir))
    resumed = run(ppo_config("_2_sokoban", "trainer.total_training_steps=2", *common, resumed_dir))
    step2 = [read_metrics(d / "metrics.jsonl")[-1] for d in (straight, resumed)]
    assert "diag/mi/estimate" in step2[1] and "diag/mi/estimate" not in step2[0]
    for key in ("actor/pg_loss", "critic/vf_loss", "critic/score/mean", "rollout/old_log_prob"):
        assert step2[0][key] == pytest.approx(step2[1][key], rel=1e-5, abs=1e-7), key
    actors = [AutoModelForCausalLM.from_pretrained(d / "global_step_2" / "actor") for d in (straight, resumed)]
    for (name, a), (_, b) in zip(actors[0].named_parameters(), actors[1].named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)

"""`trainer.stop_after_uniform_scores`: a run whose rollouts score every trajectory the same, step after step (the
format collapse: every answer malformed), validates, saves and stops with status 4 instead of holding its GPU."""

from __future__ import annotations

import pytest
import torch

from SPA_agent.runs import checkpoints
from SPA_agent.runs.metrics_logger import read_metrics
from SPA_agent.trainer.algos import uniform_score
from SPA_agent.trainer.config_checks import check_config
from SPA_agent.trainer.main_ppo import EXIT_REWARD_SIGNAL_LOST


def test_uniform_score_is_the_score_every_trajectory_shares_or_none():
    # token-level scores: each row's score sits on its last response token (any position sums the same)
    same = torch.tensor([[0.0, 0.0, -0.5], [0.0, -0.5, 0.0], [-0.5, 0.0, 0.0]])
    assert uniform_score(same) == pytest.approx(-0.5)
    turns = torch.tensor([[-0.1, -0.1, -0.1, -0.1, -0.1], [0.0, 0.0, 0.0, 0.0, -0.5]])  # 5 × -0.1 vs one -0.5
    assert uniform_score(turns) == pytest.approx(-0.5)  # equal up to float rounding
    assert uniform_score(torch.tensor([[0.0, -0.5], [0.0, 9.5]])) is None  # one success
    assert uniform_score(torch.tensor([[0.0, -0.5], [0.0, -0.6]])) is None  # one step penalty more


def test_a_run_whose_every_trajectory_scores_the_same_stops_after_the_streak_with_status_4(tmp_path, call_entry):
    """The tiny model's 8 random tokens are never a well-formed answer: every trajectory of every step gets the
    format penalty, so with a streak of 2 the run stops after step 2 of 3, validated and saved."""
    from SPA_agent.trainer import main_ppo

    code, err = call_entry(main_ppo, ["--config-name", "_2_sokoban", "model=tiny", "trainer.device=cpu",
                                      "trainer.total_training_steps=3", "trainer.stop_after_uniform_scores=2",
                                      "trainer.test_freq=10", "trainer.save_freq=0", "es_manager.train.env_groups=2",
                                      "es_manager.train.env_configs.n_groups=[2]", "es_manager.val.env_groups=2",
                                      "es_manager.val.env_configs.n_groups=[2]", "agent_proxy.max_turn=1",
                                      "actor_rollout_ref.rollout.response_length=8", "ppo_mini_batch_size=2",
                                      f"trainer.default_local_dir={tmp_path}"])
    assert code == EXIT_REWARD_SIGNAL_LOST == 4
    assert "stopped after step 2 of 3" in err and "trainer.stop_after_uniform_scores" in err
    records = read_metrics(tmp_path / "metrics.jsonl")
    training = [r for r in records if r["step"] > 0]
    assert [r["rollout/uniform_score_streak"] for r in training] == [1.0, 2.0]
    assert training[0]["critic/score/min"] == training[0]["critic/score/max"]
    assert "val-env/SimpleSokoban/success" in training[-1]  # validated at the stop, as at a last step
    assert checkpoints.saved_steps(tmp_path) == [2]


def test_the_streak_is_a_whole_number_of_steps(ppo_config):
    with pytest.raises(ValueError, match=r"trainer\.stop_after_uniform_scores"):
        check_config(ppo_config("_2_sokoban", "trainer.stop_after_uniform_scores=0"))

"""Critic-free estimators (verl's Dr. GRPO, RLOO, REINFORCE++, REINFORCE++-baseline) through
algos.compute_advantages on hand-computed vectors; DAPO's zero-variance group drop (alone and in a trainer step);
the loss pieces and presets they use."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import core_algos

from SPA_agent.trainer import algos
from SPA_agent.trainer.config_checks import check_config
from SPA_agent.trainer.local_backend.backend import _loss_normalisers
from SPA_agent.trainer.metrics import PhaseTimer
from SPA_agent.trainer.ppo_trainer import PPOTrainer

# Two groups of two trajectories, each trained on two tokens; the score sits on a different trained token per row.
MASK = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 1]], dtype=torch.float32)
GROUPS = np.array([0, 0, 1, 1])


def _scores(values: list[float]) -> torch.Tensor:
    """(4, 4) token rewards: row i's score on its last trained token."""
    rewards = torch.zeros_like(MASK)
    for row, value in enumerate(values):
        rewards[row, int(MASK[row].nonzero().max())] = value
    return rewards


def _advantages(estimator: str, rewards: torch.Tensor, mask=MASK, groups=GROUPS, **kwargs):
    return algos.compute_advantages(rewards, None, mask, mask, gamma=kwargs.pop("gamma", 1.0), lam=1.0,
                                    estimator=estimator, group_ids=groups, **kwargs)


def test_dr_grpo_is_the_mean_centred_score_without_std_division():
    advantages, returns = _advantages("grpo", _scores([1.0, 0.0, 3.0, 1.0]), norm_adv_by_std_in_grpo=False)
    per_row = torch.tensor([0.5, -0.5, 1.0, -1.0])
    torch.testing.assert_close(advantages, per_row[:, None] * MASK)
    torch.testing.assert_close(returns, advantages)


def test_rloo_baseline_is_the_mean_of_the_other_group_members():
    mask = torch.ones(6, 2)
    rewards = torch.zeros(6, 2)
    rewards[:, 1] = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0])  # groups of three
    advantages, _ = _advantages("rloo", rewards, mask=mask, groups=np.array([0, 0, 0, 1, 1, 1]))
    # row 0: 1 − mean(0, 0) = 1; row 1: 0 − mean(1, 0) = −0.5; row 3: 2 − mean(2, 5) = −1.5; row 5: 5 − 2 = 3
    per_row = torch.tensor([1.0, -0.5, -0.5, -1.5, -1.5, 3.0])
    torch.testing.assert_close(advantages, per_row[:, None] * mask)


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens_over_the_batch():
    advantages, _ = _advantages("reinforce_plus_plus_baseline", _scores([1.0, 0.0, 2.0, 2.0]))
    # centred: ±0.5 on the four tokens of group 0, 0 on group 1; mean 0, unbiased var = 4·0.25 / 7 = 1/7
    half = 0.5 * 7**0.5
    per_row = torch.tensor([half, -half, 0.0, 0.0])
    torch.testing.assert_close(advantages, per_row[:, None] * MASK, atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_discounts_over_trained_tokens_only_then_whitens():
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 1]], dtype=torch.float32)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    advantages, returns = _advantages("reinforce_plus_plus", rewards, mask=mask, groups=None, gamma=0.5)
    # the observation token (column 2) neither discounts nor receives: returns 0.25, 0.5, 0, 1 on row 0
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    on = mask.bool()
    trained = returns[on]
    expected = (trained - trained.mean()) / trained.var(unbiased=True).sqrt()
    torch.testing.assert_close(advantages[on], expected, atol=1e-5, rtol=1e-5)
    assert (advantages[~on] == 0).all()


@pytest.mark.parametrize("estimator", list(algos.OUTCOME_ESTIMATORS))
def test_critic_free_estimators_ignore_where_the_score_sits_and_build_no_critic(estimator):
    scores = [1.0, 0.0, 3.0, 1.0]
    last, _ = _advantages(estimator, _scores(scores))
    first = torch.zeros_like(MASK)
    first[torch.arange(4), MASK.argmax(dim=-1)] = torch.tensor(scores)
    again, _ = _advantages(estimator, first)
    if estimator != "reinforce_plus_plus":  # its return-to-go depends on the position, by design
        torch.testing.assert_close(again, last)
    assert not algos.needs_critic(estimator)
    assert (last[MASK == 0] == 0).all()


def test_group_estimators_refuse_a_batch_without_group_ids():
    with pytest.raises(ValueError, match="group ids"):
        _advantages("rloo", _scores([1.0, 0.0, 1.0, 1.0]), groups=None)


def test_unknown_estimator_lists_the_choices():
    with pytest.raises(ValueError, match="reinforce_plus_plus_baseline"):
        algos.needs_critic("ppo")


# --------------------------------------------------------------------------------------------------------
# DAPO pieces: dynamic sampling (zero-variance groups dropped) and the loss aggregations
# --------------------------------------------------------------------------------------------------------


def test_zero_variance_groups_are_dropped():
    # groups of two: [1, 1] (equal), [0, 1], [0, 0] (equal), [-1, 1]
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, -1.0, 1.0])
    rm = torch.zeros(8, 3)
    rm[:, -1] = scores
    rows, metrics = algos.drop_zero_variance_groups(rm, group_size=2)
    assert rows.tolist() == [2, 3, 6, 7]
    assert metrics == {"rollout/zero_variance_groups_dropped": 2.0}
    rows, metrics = algos.drop_zero_variance_groups(torch.ones(4, 3), group_size=2)
    assert rows.tolist() == [] and metrics["rollout/zero_variance_groups_dropped"] == 2.0


def test_token_sum_norm_divides_by_the_configured_constant():
    """seq-mean-token-sum-norm (Dr. GRPO): Σ_tokens loss per sequence, mean over sequences, / loss_scale_factor."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    agg = core_algos.agg_loss(loss, mask, "seq-mean-token-sum-norm", **_loss_normalisers(mask, 10))
    assert agg.item() == pytest.approx((3.0 + 4.0) / 2 / 10)
    agg = core_algos.agg_loss(loss, mask, "seq-mean-token-sum-norm", **_loss_normalisers(mask))
    assert agg.item() == pytest.approx((3.0 + 4.0) / 2 / 3)  # verl's default: the padded length
    agg = core_algos.agg_loss(loss, mask, "token-mean", **_loss_normalisers(mask))
    assert agg.item() == pytest.approx((1.0 + 2.0 + 4.0) / 3)


def test_critic_free_estimators_and_the_group_drop_are_local_backend_only(ppo_config):
    for override, message in (("algorithm.adv_estimator=rloo", "adv_estimator=rloo runs on trainer.backend=local"),
                              ("algorithm.drop_zero_variance_groups=True", "drop_zero_variance_groups")):
        cfg = ppo_config("_2_sokoban", override, "trainer.backend=verl")
        with pytest.raises(ValueError, match=message):
            check_config(cfg)
        check_config(ppo_config("_2_sokoban", override))


def test_loss_scale_factor_must_be_a_positive_integer(ppo_config):
    with pytest.raises(ValueError, match="loss_scale_factor must be a positive integer"):
        check_config(ppo_config("_2_sokoban", "actor_rollout_ref.actor.loss_scale_factor=0"))
    check_config(ppo_config("_2_sokoban", "actor_rollout_ref.actor.loss_scale_factor=400"))


@pytest.mark.parametrize("preset, expected", [
    ("dr_grpo", {"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": False,
                 "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm",
                 "actor_rollout_ref.actor.loss_scale_factor": 16}),  # TINY_PPO's response_length
    ("dapo", {"algorithm.adv_estimator": "grpo", "algorithm.drop_zero_variance_groups": True,
              "actor_rollout_ref.actor.loss_agg_mode": "token-mean", "actor_rollout_ref.actor.clip_ratio_high": 0.28}),
])
def test_algorithm_presets_compose_and_pass_the_checks(ppo_config, preset, expected):
    cfg = ppo_config("_2_sokoban", f"+algo={preset}")
    check_config(cfg)
    assert {key: OmegaConf.select(cfg, key) for key in expected} == expected


class _Rollout:
    """What LLMAgentProxy.rollout returns, for a hand-made batch."""

    def __init__(self, batch):
        self.batch, self.metrics = batch, {}


class _RecordingBackend:
    """A worker group that records the batch it is asked to score, then stops the step."""

    has_ref = False

    def __init__(self):
        self.rows = None

    def compute_log_prob(self, batch):
        self.rows = batch.batch["rm_scores"][:, -1].tolist()
        raise StopIteration


def _trainer_step(ppo_config, scores: list[float]):
    cfg = ppo_config("_2_sokoban", "+algo=dapo", "actor_rollout_ref.rollout.rollout_filter_ratio=1",
                     "es_manager.train.group_size=2")
    rm_scores = torch.zeros(len(scores), 3)
    rm_scores[:, -1] = torch.tensor(scores)
    groups = np.arange(len(scores)) // 2
    batch = DataProto.from_dict(tensors={"rm_scores": rm_scores, "loss_mask": torch.ones(len(scores), 3),
                                         "response_mask": torch.ones(len(scores), 3)},
                                non_tensors={"group_ids": groups, "seeds": groups})

    class Proxy:
        def rollout(self, val):
            return _Rollout(batch)

    backend = _RecordingBackend()
    trainer = PPOTrainer(cfg, backend, Proxy(), logger=None)
    try:
        metrics = trainer.train_step(1, PhaseTimer())
    except StopIteration:
        metrics = None
    return backend.rows, metrics


def test_dapo_step_trains_only_on_groups_with_varied_scores(ppo_config):
    rows, _ = _trainer_step(ppo_config, [1.0, 1.0, 0.0, 1.0])
    assert rows == [0.0, 1.0]


def test_dapo_step_without_varied_groups_skips_the_update(ppo_config):
    rows, metrics = _trainer_step(ppo_config, [1.0, 1.0, 0.0, 0.0])
    assert rows is None  # the backend was never asked to score anything
    assert metrics["rollout/zero_variance_groups_dropped"] == 2.0
    assert not any(key.startswith(("actor/", "critic/")) for key in metrics)

"""Pure algorithm pieces: StarPO-S filter, verl GAE behaviour we rely on, bi-level GAE, KL in reward."""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F

from SPA_agent.trainer import algos

# Four groups of two trajectories; score = row sum. Group stats (std unbiased, mean):
# g0 [1, 1] -> std 0, mean 1; g1 [0, 1] -> 0.707, 0.5; g2 [0, 0] -> 0, 0; g3 [-1, 1] -> 1.414, 0.
SCORES = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, -1.0, 1.0])


def _rm_scores(scores: torch.Tensor, length: int = 5) -> torch.Tensor:
    """(B, length) token scores with each trajectory's score on its last column."""
    rm = torch.zeros(scores.numel(), length)
    rm[:, -1] = scores
    return rm


@pytest.mark.parametrize(
    "filter_type, rows",
    [("std", [2, 3, 6, 7]), ("std_rev", [0, 1, 4, 5]), ("max_mean", [0, 1, 2, 3])],
)
def test_filter_keeps_expected_groups(filter_type, rows):
    kept, _ = algos.rollout_filter(_rm_scores(SCORES), group_size=2, ratio=0.5, filter_type=filter_type)
    assert kept.tolist() == rows


def test_filter_metrics_are_group_means():
    _, metrics = algos.rollout_filter(_rm_scores(SCORES), group_size=2, ratio=0.5, filter_type="std")
    std = 2**0.5
    assert metrics["rollout/in_group_std"] == pytest.approx((0 + std / 2 + 0 + std) / 4)
    assert metrics["rollout/in_group_mean"] == pytest.approx(1.5 / 4)
    assert metrics["rollout/in_group_max"] == pytest.approx(3 / 4)
    assert metrics["rollout/chosen_in_group_std"] == pytest.approx((std / 2 + std) / 2)
    assert metrics["rollout/chosen_in_group_mean"] == pytest.approx(0.25)


def test_filter_ratio_one_keeps_everything_and_ratio_rounds_down():
    kept, _ = algos.rollout_filter(_rm_scores(SCORES), 2, 1.0, "std")
    assert kept.tolist() == list(range(8))
    kept, _ = algos.rollout_filter(_rm_scores(SCORES), 2, 0.3, "std")  # int(0.3 * 4) = 1 group
    assert kept.tolist() == [6, 7]


def test_filter_errors_name_the_fix():
    with pytest.raises(ValueError, match="std_rev"):
        algos.rollout_filter(_rm_scores(SCORES), 2, 0.5, "best")
    with pytest.raises(ValueError, match="keeps no group"):
        algos.rollout_filter(_rm_scores(SCORES), 2, 0.1, "std")


def test_gae_returns_equal_terminal_reward_when_gamma_and_lambda_are_one():
    """A_t = R − V_t before whitening, i.e. returns = R on every masked-in position."""
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    rewards[0, 6], rewards[1, 6] = 2.0, -1.0
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    advantages, returns = algos.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    on = mask.bool()
    torch.testing.assert_close(returns[on], torch.tensor([2.0] * 5 + [-1.0] * 5))
    expected = verl_F.masked_whiten(torch.tensor([[2.0], [-1.0]]) - values, mask)
    torch.testing.assert_close(advantages[on], expected[on])


def test_verl_gae_skips_masked_positions():
    """Pins verl 0.9.1: values on masked (observation) positions do not change GAE on trained positions."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]], dtype=torch.float32)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    gamma, lam = 0.9, 0.8
    _, returns = algos.gae(rewards, values, mask, gamma, lam)
    other = values.clone()
    other[0, 2:4] = torch.tensor([5.0, -7.0])
    _, returns_other = algos.gae(rewards, other, mask, gamma, lam)
    on = mask.bool()
    torch.testing.assert_close(returns[on], returns_other[on])
    # Hand-computed: the recursion jumps from position 4 to position 1 as if 2, 3 did not exist.
    a5 = 1.0 - 0.6
    a4 = gamma * 0.6 - 0.5 + gamma * lam * a5
    a1 = gamma * 0.5 - 0.2 + gamma * lam * a4
    a0 = gamma * 0.2 - 0.1 + gamma * lam * a1
    torch.testing.assert_close(returns[on], torch.tensor([a0 + 0.1, a1 + 0.2, a4 + 0.5, a5 + 0.6]))


@pytest.mark.parametrize("dtype, mask_dtype, gamma, lam", [
    (torch.float32, torch.float32, 1.0, 1.0), (torch.float32, torch.int32, 0.99, 0.95),
    (torch.float32, torch.int64, 0.9, 1.0), (torch.float64, torch.float32, 0.97, 0.9),
    (torch.bfloat16, torch.float32, 1.0, 0.95),
])
def test_gae_is_verls_bit_for_bit(dtype, mask_dtype, gamma, lam):
    """algos.gae runs verl 0.9.1's recursion in numpy (issue 42): advantages and returns equal verl's exactly, on
    multi-turn-like masks (runs of trained tokens between untrained ones, rows of different lengths, an empty row)
    with rewards inside the mask, dense and terminal."""
    generator = torch.Generator().manual_seed(7)
    rows, length = 16, 300
    mask = (torch.rand(rows, length, generator=generator) < 0.35).to(mask_dtype)
    mask[3] = 0  # a row with nothing to train
    values = torch.randn(rows, length, generator=generator).to(dtype)
    rewards = (torch.randn(rows, length, generator=generator) * (torch.rand(rows, length, generator=generator) < 0.05)
               * mask).to(dtype)
    ends = mask.to(torch.float32).cumsum(-1).argmax(-1)  # each row's last trained position
    rewards[torch.arange(rows), ends] += torch.where(mask.any(-1), 1.0, 0.0).to(dtype)
    expected = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    for got, want in zip(algos.gae(rewards, values, mask, gamma, lam), expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_reward_outside_mask_is_refused():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    with pytest.raises(ValueError, match="outside its loss_mask"):
        algos.gae(rewards, torch.zeros_like(mask), mask, 1.0, 1.0)


def test_bi_level_gae_matches_hand_computation():
    # Two assistant turns (positions 1-2 and 4-5); observation at 0 and 3; final reward 1 on position 5.
    mask = torch.tensor([[0, 1, 1, 0, 1, 1]], dtype=torch.float32)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.0, 0.1, 0.2, 0.0, 0.3, 0.4]])
    advantages, returns = algos.bi_level_gae(rewards, values, mask, mask, 1.0, 1.0, high_level_gamma=0.5)
    # Turn level (V_1 = 0.2, V_2 = 0.4): A_2 = 1 − 0.4 = 0.6, G_2 = 1; A_1 = 0.5·0.4 − 0.2 + 0.5·0.6 = 0.3, G_1 = 0.5.
    # Token level with γ = λ = 1 inside a turn: returns = the turn return.
    on = mask.bool()
    torch.testing.assert_close(returns[on], torch.tensor([0.5, 0.5, 1.0, 1.0]))
    raw = torch.tensor([[0.0, 0.4, 0.3, 0.0, 0.7, 0.6]])
    torch.testing.assert_close(advantages[on], verl_F.masked_whiten(raw, mask)[on])


def test_bi_level_gae_with_unit_discounts_equals_gae_returns():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 0, 1, 1]], dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    rewards[:, -1] = torch.tensor([1.0, -0.5])
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    _, plain = algos.gae(rewards, values, mask, 1.0, 1.0)
    _, bi = algos.bi_level_gae(rewards, values, mask, mask, 1.0, 1.0, high_level_gamma=1.0)
    torch.testing.assert_close(bi[mask.bool()], plain[mask.bool()])


def test_kl_penalty_in_reward_only_on_mask():
    scores = torch.tensor([[0.0, 0.0, 1.0]])
    old, ref = torch.tensor([[-1.0, -2.0, -1.0]]), torch.tensor([[-1.5, -1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    rewards, kl = algos.apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kl_penalty="kl")
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.1, 1.0]]))
    assert kl == pytest.approx(-0.5)
    expected = core_algos.kl_penalty(old, ref, "kl") * mask
    torch.testing.assert_close(rewards, scores - 0.1 * expected)


def test_grpo_advantage_is_the_group_normalised_score_wherever_it_sits():
    """verl's GRPO through algos.compute_advantages: (score − group mean) / group std on every masked token."""
    import numpy as np

    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)
    scores = torch.zeros(4, 4)
    scores[0, 2], scores[1, 1], scores[2, 1], scores[3, 0] = 1.0, 0.0, 3.0, 1.0  # groups {0, 1} and {2, 3}
    advantages, returns = algos.compute_advantages(scores, None, mask, mask, gamma=1.0, lam=1.0, estimator="grpo",
                                                   group_ids=np.array([0, 0, 1, 1]))
    per_row = torch.tensor([1.0, -1.0, 1.0, -1.0]) / 2**0.5  # (x − mean) / unbiased std of a pair
    torch.testing.assert_close(advantages, per_row[:, None] * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(returns, advantages)
    assert algos.needs_critic("gae") and not algos.needs_critic("grpo")

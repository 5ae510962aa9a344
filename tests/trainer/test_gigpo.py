"""GiGPO-style step-level grouping (SPA_agent/trainer/gigpo.py): known vectors, its GRPO limit, a tiny run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from turn_spans import turn_spans

from SPA_agent.runs.metrics_logger import read_metrics
from SPA_agent.trainer import algos
from SPA_agent.trainer.gigpo import discounted_returns, gigpo_advantages, step_advantages
from SPA_agent.trainer.main_ppo import run

#: group 0: three trajectories that all start in state A; trajectories 0 and 2 both reach B, 1 reaches C.
#: group 1: one trajectory in state A too, which must not join group 0's step group.
STATES = [["A", "B"], ["A", "C"], ["A", "B"], ["A"]]
REWARDS = [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0]]
GROUPS = np.array([0, 0, 0, 1])


def test_step_return_is_the_discounted_reward_to_go():
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_returns([1.0, -1.0, 2.0], 1.0) == [2.0, 1.0, 2.0]


def test_step_advantages_compare_turns_from_the_same_state_within_a_group():
    # (0, A): returns [1, 0, 0], mean 1/3; (0, B): returns [1, 0], mean 1/2; (0, C) and (1, A) are alone: 0
    got = step_advantages(STATES, REWARDS, GROUPS, gamma=1.0, norm_by_std=False)
    expected = [[2 / 3, 0.5], [-1 / 3, 0.0], [-1 / 3, -0.5], [0.0]]
    for row, want in zip(got, expected):
        assert row == pytest.approx(want)
    # divided by the step group's unbiased std: sqrt(1/3) for (0, A), sqrt(1/2) for (0, B)
    normed = step_advantages(STATES, REWARDS, GROUPS, gamma=1.0, norm_by_std=True)
    a, b = 1 / math.sqrt(1 / 3), 1 / math.sqrt(1 / 2)
    expected = [[2 / 3 * a, 0.5 * b], [-1 / 3 * a, 0.0], [-1 / 3 * a, -0.5 * b], [0.0]]
    for row, want in zip(normed, expected):
        assert row == pytest.approx(want, rel=1e-5)


def _three_trajectories() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 0–2 of STATES: turn 0 on positions 1–2, turn 1 on 5–6; the score (1, 0, 0) on the last one."""
    mask = torch.zeros(3, 8)
    mask[:, 1:3] = 1
    mask[:, 5:7] = 1
    rewards = torch.zeros(3, 8)
    rewards[0, 6] = 1.0
    return rewards, mask


def test_token_advantage_is_episode_plus_weighted_step_advantage():
    rewards, mask = _three_trajectories()
    adv, returns = gigpo_advantages(rewards, mask, mask, GROUPS[:3], STATES[:3], REWARDS[:3], step_gamma=1.0,
                                    step_weight=1.0, norm_by_std=False)
    # episode: scores (1, 0, 0) minus 1/3; step: as in the test above
    per_turn = torch.tensor([[2 / 3 + 2 / 3, 2 / 3 + 0.5], [-1 / 3 - 1 / 3, -1 / 3], [-1 / 3 - 1 / 3, -1 / 3 - 0.5]])
    expected = torch.zeros(3, 8)
    expected[:, 1:3] = per_turn[:, :1]
    expected[:, 5:7] = per_turn[:, 1:]
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, adv)


def test_zero_step_weight_is_grpo():
    rewards, mask = _three_trajectories()
    adv, _ = gigpo_advantages(rewards, mask, mask, GROUPS[:3], STATES[:3], REWARDS[:3], step_gamma=0.95,
                              step_weight=0.0)
    torch.testing.assert_close(adv, algos.grpo(rewards, mask, GROUPS[:3])[0])


def test_turn_count_mismatch_is_refused():
    rewards, mask = _three_trajectories()
    with pytest.raises(ValueError, match="turns in the token masks"):
        gigpo_advantages(rewards, mask, mask, GROUPS[:3], [["A"]] * 3, [[0.0]] * 3, step_gamma=1.0)


def expected_turn_advantages(scores, turn_states, turn_rewards, group_ids, gamma, weight):
    """Per trajectory, per turn: (score − group mean)/(group std + ε) + weight · (R − mean)/(std + ε) over the
    turns of its group with the same anchor state (0 alone), R the discounted reward to go; written out here,
    apart from gigpo.py."""
    def normalised(values):
        mean = sum(values) / len(values)
        if len(values) < 2:
            return [0.0 for _ in values]
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        return [(v - mean) / (std + 1e-6) for v in values]

    episode = {}
    for group in set(group_ids):
        rows = [i for i, g in enumerate(group_ids) if g == group]
        episode.update(zip(rows, normalised([scores[i] for i in rows])))
    returns = [[sum(r * gamma**k for k, r in enumerate(rewards[t:])) for t in range(len(rewards))]
               for rewards in turn_rewards]
    step = {}
    for key in {(group_ids[i], state) for i, states in enumerate(turn_states) for state in states}:
        turns = [(i, t) for i, states in enumerate(turn_states) for t, state in enumerate(states)
                 if (group_ids[i], state) == key]
        step.update(zip(turns, normalised([returns[i][t] for i, t in turns])))
    return [[episode[i] + weight * step[(i, t)] for t in range(len(states))] for i, states in enumerate(turn_states)]


def test_gigpo_ppo_trains_each_turn_with_its_step_level_advantage(ppo_config, advantage_batches):
    """Two steps without a critic; each trained turn's tokens carry GiGPO's advantage, recomputed here from the
    rollout's turn states and rewards. GRPO would give every token of a trajectory the same value: here turns of
    one trajectory differ, which only the step-level part produces."""
    cfg = ppo_config("_2_sokoban", "algorithm.adv_estimator=gigpo", "trainer.test_freq=0")
    output = run(cfg)
    records = read_metrics(output / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all("critic/vf_loss" not in r for r in records)
    assert not (output / "global_step_2" / "critic").exists()
    assert len(advantage_batches) == 2
    varies_within_a_trajectory = False
    for batch in advantage_batches:
        t, nt = batch.batch, batch.non_tensor_batch
        scores = t["token_level_rewards"].sum(-1).tolist()
        expected = expected_turn_advantages(scores, nt["turn_states"], nt["turn_rewards"], list(nt["group_ids"]),
                                            cfg.algorithm.step_gamma, cfg.algorithm.step_weight)
        for row, want in enumerate(expected):
            spans = turn_spans(t["response_mask"][row])
            assert len(spans) == len(want)
            got = [t["advantages"][row, span] for span in spans]
            for turn, values in enumerate(got):
                torch.testing.assert_close(values, torch.full_like(values, want[turn]), rtol=1e-4, atol=1e-5)
            varies_within_a_trajectory |= len({round(v[0].item(), 4) for v in got}) > 1
    assert varies_within_a_trajectory

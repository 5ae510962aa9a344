"""GiGPO-style advantages (Feng et al., "Group-in-Group Policy Optimization for LLM Agent Training",
arXiv 2505.10978): GRPO's episode-level advantage plus a step-level one from turns that start in the same state.

For trajectory i of group g (the `group_size` trajectories of one seed) and its assistant turn t:

    A(i, t) = A_episode(i) + ω · A_step(i, t)

A_episode is GRPO's (score − group mean) / (group std + ε) over the trajectory scores. The step return of a turn
is R(i, t) = Σ_{k ≥ t} γ^(k − t) r(i, k) (r = the turn's environment reward; the format penalty counts on the last
turn). Turns of group g whose anchor state (the environment's render before the turn) is identical form a step
group, wherever they occur in their trajectories; A_step is R minus the step group's mean, divided by its std + ε
(`norm_by_std=False`: not divided). A turn whose state no other turn of its group saw has A_step = 0: nothing to
compare it with. Every token of turn t trains with A(i, t). No critic.

Pure functions of tensors and lists; the rollout supplies `turn_states` and `turn_rewards` (docs/interfaces.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np
import torch
from verl.trainer.ppo import core_algos

from SPA_agent.rollout.rewards import turn_ends

EPS = 1e-6


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_t = Σ_{k ≥ t} γ^(k − t) r_k for one trajectory's turn rewards."""
    returns, running = [], 0.0
    for reward in reversed(rewards):
        running = float(reward) + gamma * running
        returns.append(running)
    return returns[::-1]


def step_advantages(
    turn_states: Sequence[Sequence[Hashable]],
    turn_rewards: Sequence[Sequence[float]],
    group_ids: Sequence[Hashable],
    gamma: float,
    norm_by_std: bool = True,
) -> list[list[float]]:
    """A_step(i, t) for every turn of every trajectory, grouped by (group id, anchor state).

    Args:
        turn_states: per trajectory, the anchor state of each turn (any hashable, e.g. the rendered grid).
        turn_rewards: per trajectory, the reward of each turn (same lengths as `turn_states`).
        group_ids: (B,) the rollout group of each trajectory; states are only compared within a group.
        gamma: discount of the step return over later turns.
        norm_by_std: divide by the step group's (unbiased) std + 1e-6.
    Returns:
        per trajectory, one step advantage per turn.
    """
    returns = [discounted_returns(r, gamma) for r in turn_rewards]
    members: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for i, (states, rets) in enumerate(zip(turn_states, returns)):
        if len(states) != len(rets):
            raise ValueError(f"trajectory {i} has {len(states)} turn states but {len(rets)} turn rewards")
        for t, state in enumerate(states):
            members[(group_ids[i], state)].append((i, t))
    advantages = [[0.0] * len(r) for r in returns]
    for turns in members.values():
        if len(turns) < 2:
            continue
        values = torch.tensor([returns[i][t] for i, t in turns], dtype=torch.float64)
        centred = values - values.mean()
        if norm_by_std:
            centred = centred / (values.std() + EPS)
        for (i, t), value in zip(turns, centred.tolist()):
            advantages[i][t] = value
    return advantages


def turn_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a (B, T-1) mask of assistant tokens: each position's turn number (0 = first turn; positions between
    turns belong to the next one) and the number of turns per row, (B,)."""
    ends = turn_ends(mask)
    return torch.cumsum(ends.long(), dim=-1) - ends.long(), ends.sum(dim=-1)


def gigpo_advantages(
    token_level_rewards: torch.Tensor,
    mask: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: np.ndarray,
    turn_states: Sequence[Sequence[Hashable]],
    turn_rewards: Sequence[Sequence[float]],
    step_gamma: float,
    step_weight: float = 1.0,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), equal, both (B, T-1): A_episode + ω·A_step on every `mask` position of each turn.

    Args:
        token_level_rewards: (B, T-1); a trajectory's score is its row sum (the episode-level part).
        mask: (B, T-1) the trained positions; response_mask: (B, T-1) the sampled (assistant) tokens, whose runs
            are the turns, in the order of `turn_states`.
    """
    episode, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=token_level_rewards, response_mask=mask, index=group_ids,
        norm_adv_by_std_in_grpo=norm_by_std)
    steps = step_advantages(turn_states, turn_rewards, list(group_ids), step_gamma, norm_by_std)
    turn_of, n_turns = turn_index(response_mask * mask)
    if n_turns.tolist() != [len(s) for s in steps]:
        raise ValueError(f"turns in the token masks {n_turns.tolist()} differ from the rollout's turn states "
                         f"{[len(s) for s in steps]}")
    width = max(1, max(len(s) for s in steps))
    table = torch.tensor([s + [0.0] * (width + 1 - len(s)) for s in steps], dtype=token_level_rewards.dtype)
    step_per_token = table.gather(1, turn_of.clamp(max=width))  # past the last turn: the 0 padding column
    advantages = (episode + step_weight * step_per_token) * mask
    return advantages, advantages

"""PPO algorithm pieces as pure tensor functions: the StarPO-S rollout filter, rewards, advantages.

Notation (spec §10.3, docs/interfaces.md "One rollout"):
    B  trajectories in the batch (env_groups × group_size before filtering)
    G  group_size: consecutive rows that share a seed (one puzzle)
    T  sequence length of `input_ids`; every (B, T-1) tensor is aligned with `responses = input_ids[:, 1:]`
    mask  `loss_mask` (B, T-1): the positions that train (the driver sets `response_mask := loss_mask`)

GAE, GRPO, RLOO, REINFORCE++ and the losses come from `verl.trainer.ppo.core_algos`; this module only adds the
rollout filters (StarPO-S, zero-variance groups) and the bi-level GAE glue (turn-level GAE, then token-level
GAE inside each turn); GiGPO's step-level grouping is in `gigpo.py`. No models, no processes.
"""

from __future__ import annotations

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F

from SPA_agent.rollout.rewards import turn_ends
from SPA_agent.trainer.gigpo import gigpo_advantages

# --------------------------------------------------------------------------------------------------------
# StarPO-S rollout filter (spec §10.3 step 2)
# --------------------------------------------------------------------------------------------------------

#: filter type -> group statistic to rank by, and whether the largest values are kept.
ROLLOUT_FILTERS: dict[str, tuple[str, bool]] = {
    "std": ("std", True),  # keep the groups whose trajectories disagree most (the paper's StarPO-S)
    "std_rev": ("std", False),  # keep the most uniform groups
    "max_mean": ("mean", True),  # keep the groups with the highest mean score
}


def group_score_stats(scores: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Per-group statistics of trajectory scores.

    Args:
        scores: (B,) one score per trajectory; rows g·G … g·G+G−1 form group g.
        group_size: G; B must be a multiple of it.
    Returns:
        {"std", "max", "mean"}: each (B // G,); std is the unbiased sample std (0 for G = 1).
    """
    if scores.numel() % group_size:
        raise ValueError(f"batch of {scores.numel()} trajectories is not a multiple of group_size={group_size}")
    grouped = scores.float().view(-1, group_size)
    std = grouped.std(dim=1, unbiased=True) if group_size > 1 else torch.zeros(grouped.shape[0])
    return {"std": std, "max": grouped.max(dim=1).values, "mean": grouped.mean(dim=1)}


def select_groups(stats: dict[str, torch.Tensor], ratio: float, filter_type: str) -> torch.Tensor:
    """Indices (ascending) of the `int(ratio × n_groups)` groups kept by the filter; ties keep earlier groups."""
    if filter_type not in ROLLOUT_FILTERS:
        raise ValueError(f"unknown rollout_filter_type {filter_type!r}; choose one of {sorted(ROLLOUT_FILTERS)}")
    key, keep_largest = ROLLOUT_FILTERS[filter_type]
    n_groups = stats[key].numel()
    n_keep = n_groups if ratio >= 1 else int(ratio * n_groups)
    if n_keep < 1:
        raise ValueError(f"rollout_filter_ratio={ratio} keeps no group out of {n_groups}; raise it")
    order = torch.argsort(stats[key], descending=keep_largest, stable=True)
    return order[:n_keep].sort().values


def rollout_filter(
    rm_scores: torch.Tensor, group_size: int, ratio: float, filter_type: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """StarPO-S: keep the groups ranked best by `filter_type`.

    Args:
        rm_scores: (B, T-1) token-level scores; a trajectory's score is the sum of its row.
    Returns:
        row indices (ascending) of the kept trajectories, and the metrics
        `rollout/in_group_{std,max,mean}` (mean over all groups) and `rollout/chosen_in_group_*` (kept groups).
    """
    stats = group_score_stats(rm_scores.sum(dim=-1), group_size)
    groups = select_groups(stats, ratio, filter_type)
    rows = (groups[:, None] * group_size + torch.arange(group_size)[None, :]).flatten()
    metrics = {}
    for name, values in stats.items():
        metrics[f"rollout/in_group_{name}"] = values.mean().item()
        metrics[f"rollout/chosen_in_group_{name}"] = values[groups].mean().item()
    return rows, metrics


def drop_zero_variance_groups(
    rm_scores: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO's dynamic sampling without the resampling: drop the groups whose trajectories all scored the same.

    Such a group gives every trajectory a zero advantage under GRPO-style estimators, so it only dilutes the
    loss. Unlike DAPO, no new rollouts refill the batch: the batch shrinks (possibly to nothing).

    Args:
        rm_scores: (B, T-1) token-level scores of the batch (after the StarPO-S filter); score = row sum.
    Returns:
        row indices (ascending) of the kept trajectories, and `rollout/zero_variance_groups_dropped`.
    """
    grouped = rm_scores.sum(dim=-1).float().view(-1, group_size)
    varied = (grouped != grouped[:, :1]).any(dim=1)
    groups = varied.nonzero()[:, 0]
    rows = (groups[:, None] * group_size + torch.arange(group_size)[None, :]).flatten()
    return rows, {"rollout/zero_variance_groups_dropped": float((~varied).sum())}


def uniform_score(rm_scores: torch.Tensor) -> float | None:
    """The one score every trajectory of a batch got, or None where they differ: the whole batch's case of a
    zero-variance group (trainer.stop_after_uniform_scores).

    Args:
        rm_scores: (B, T-1) token-level scores; score = row sum. Equal up to float rounding: the same penalties at
            other positions of the row are summed in another order.
    """
    scores = rm_scores.float().sum(dim=-1)
    return float(scores[0]) if bool((scores - scores[0]).abs().max() <= 1e-6) else None


# --------------------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------------------


def check_rewards_inside_mask(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> None:
    """verl 0.9.1's GAE skips masked positions, rewards included: a reward outside the mask would be lost."""
    outside = (token_level_rewards != 0) & (mask == 0)
    if outside.any():
        row = int(outside.any(dim=-1).nonzero()[0])
        raise ValueError(
            f"trajectory {row} has a reward outside its loss_mask; the rollout must place rewards on trained "
            "positions (docs/interfaces.md 'One rollout')"
        )


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str,
) -> tuple[torch.Tensor, float]:
    """token_level_rewards = scores − β·KL(π_old‖π_ref) per token over the mask (all (B, T-1)).

    Returns the rewards and the batch's mean per-trajectory KL (for the adaptive KL controller).
    """
    kl = core_algos.kl_penalty(old_log_prob, ref_log_prob, kl_penalty=kl_penalty) * mask
    rewards = token_level_scores - kl_coef * kl
    seq_kl = verl_F.masked_mean(kl, mask, axis=-1)
    return rewards, seq_kl.mean().item()


# --------------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------------


def gae(
    token_level_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GAE over the mask: (advantages whitened over the mask, returns = A + V), both (B, T-1).

    verl 0.9.1 skips masked positions (their values and rewards do not enter δ; the recursion jumps over them),
    which the tests pin. With one terminal reward R and γ = λ = 1: returns_t = R on every masked-in position.
    The recursion is `_gae_recursion`: verl's `compute_gae_advantage_return` loop, bit for bit, in numpy.
    """
    check_rewards_inside_mask(token_level_rewards, mask)
    if values.dtype not in (torch.float32, torch.float64):  # bfloat16, float16 (untested in numpy): verl's own
        return core_algos.compute_gae_advantage_return(token_level_rewards, values, mask, gamma, lam)
    with torch.no_grad():
        advantages = _gae_recursion(token_level_rewards, values, mask, gamma, lam)
        returns = advantages + values
        return verl_F.masked_whiten(advantages, mask), returns


def _gae_recursion(
    token_level_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """The unwhitened advantages of verl 0.9.1's `compute_gae_advantage_return`, (B, T-1): its backward loop over
    the columns, the same elementwise operations in the same order and dtype, so bit-identical (tested).

    Why not verl's own: its loop makes ~10 torch calls a column, and a multi-turn row has ~3,000 columns: 0.19 s of
    a SmolLM2 PPO step on an H200 host (issue 42). The same arithmetic on numpy's time-major rows costs ~1/5 of it.
    """
    def time_major(x: torch.Tensor) -> np.ndarray:
        return np.ascontiguousarray(x.detach().to("cpu", values.dtype).numpy().T)

    rewards, value, on = time_major(token_level_rewards), time_major(values), time_major(mask)
    off = 1 - on
    next_value, last_gae = np.zeros_like(value[0]), np.zeros_like(value[0])
    advantages = np.empty_like(value)
    for t in reversed(range(value.shape[0])):
        delta = rewards[t] + gamma * next_value - value[t]
        gae_t = delta + gamma * lam * last_gae
        next_value = value[t] * on[t] + off[t] * next_value
        last_gae = gae_t * on[t] + off[t] * last_gae
        advantages[t] = last_gae
    return torch.from_numpy(np.ascontiguousarray(advantages.T)).to(values.device)


def _turn_level_returns(
    rewards: torch.Tensor, values: torch.Tensor, ends: torch.Tensor, high_level_gamma: float, lam: float
) -> torch.Tensor:
    """Turn returns G_k = A_k + V_k from GAE over turns; (B, T-1) with G_k at the end of turn k, 0 elsewhere.

    Turn k covers the positions after the end of turn k−1 up to its own end; rewards after the last turn end
    belong to the last turn. V_k is the value at the end of turn k; δ_k = R_k + γ_h·V_{k+1} − V_k and
    A_k = δ_k + γ_h·λ·A_{k+1}, with V and A past the last turn equal to 0.
    """
    n_turns = ends.sum(dim=-1)
    if not ends.any():
        return torch.zeros_like(rewards)
    max_turns = int(n_turns.max())
    turn_of = (torch.cumsum(ends, dim=-1) - ends.long()).clamp(max=(n_turns - 1).clamp(min=0)[:, None])
    turn_rewards = torch.zeros(rewards.shape[0], max_turns, dtype=rewards.dtype)
    turn_rewards.scatter_add_(1, turn_of, rewards * (n_turns[:, None] > 0))
    turn_values = torch.zeros_like(turn_rewards)
    turn_values[torch.arange(max_turns)[None, :].expand_as(turn_values) < n_turns[:, None]] = values[ends]
    next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    advantage = torch.zeros_like(next_value)
    turn_returns = torch.zeros_like(turn_rewards)
    for k in reversed(range(max_turns)):
        valid = (k < n_turns).to(rewards.dtype)
        delta = turn_rewards[:, k] + high_level_gamma * next_value - turn_values[:, k]
        advantage = valid * (delta + high_level_gamma * lam * advantage)
        next_value = valid * turn_values[:, k]
        turn_returns[:, k] = advantage + turn_values[:, k]
    out = torch.zeros_like(rewards)
    out[ends] = turn_returns[torch.arange(max_turns)[None, :].expand_as(turn_returns) < n_turns[:, None]]
    return out


def bi_level_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    high_level_gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bi-level GAE (spec §10.3 step 6): GAE over turns with γ_high, then GAE over tokens inside each turn.

    Turns are the runs of `response_mask` (assistant turns). Inside turn k the token-level recursion runs
    backwards over the `mask` positions with δ_t = γ·V_{t+1} − V_t, except at the turn's last token where
    δ = G_k − V_t (the turn return bootstraps the turn; nothing flows across turn boundaries).
    Returns (advantages whitened over `mask`, returns = A + V), both (B, T-1).
    """
    check_rewards_inside_mask(token_level_rewards, mask)
    ends = turn_ends(response_mask * mask)
    with torch.no_grad():
        turn_returns = _turn_level_returns(token_level_rewards, values, ends, high_level_gamma, lam)
        next_value = torch.zeros(values.shape[0], dtype=values.dtype)
        last_gae = torch.zeros_like(next_value)
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            end, on = ends[:, t].to(values.dtype), mask[:, t].to(values.dtype)
            next_value, last_gae = next_value * (1 - end), last_gae * (1 - end)
            delta = turn_returns[:, t] + gamma * next_value - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            next_value = on * values[:, t] + (1 - on) * next_value
            last_gae = on * gae_t + (1 - on) * last_gae
            advantages[:, t] = last_gae
        returns = advantages + values
        advantages = verl_F.masked_whiten(advantages, mask)
    return advantages, returns


#: critic-free outcome estimators of core_algos (`algorithm.adv_estimator`) -> whether they read the group ids
OUTCOME_ESTIMATORS: dict[str, bool] = {
    "grpo": True,  # (score − group mean) / group std; Dr. GRPO without the division
    "rloo": True,  # score − mean score of the other trajectories of its group
    "reinforce_plus_plus": False,  # discounted return-to-go, whitened over the batch (no groups)
    "reinforce_plus_plus_baseline": True,  # score − group mean, whitened over the batch
}
#: advantage estimators (`algorithm.adv_estimator`) -> whether they need a critic (values)
ADV_ESTIMATORS: dict[str, bool] = {"gae": True, **{name: False for name in OUTCOME_ESTIMATORS}, "gigpo": False}


def needs_critic(adv_estimator: str) -> bool:
    """Whether `adv_estimator` reads critic values (only GAE: for the others no value model is built or trained)."""
    if adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={adv_estimator!r} is not supported; choose one of "
                         f"{list(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[adv_estimator]


def grpo(
    token_level_rewards: torch.Tensor, mask: torch.Tensor, group_ids: np.ndarray, norm_by_std: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO outcome advantage: (score − group mean) / (group std + 1e-6) on every `mask` position.

    The score is the row sum of `token_level_rewards` (B, T-1), so where it sits in the row does not matter;
    `group_ids` (B,) are the rollout's groups (same seed). `norm_by_std=False` is Dr. GRPO (no division).
    Returns (advantages, returns), equal, both (B, T-1).
    """
    return core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=token_level_rewards, response_mask=mask, index=group_ids,
        norm_adv_by_std_in_grpo=norm_by_std,
    )


def outcome_advantages(
    estimator: str,
    token_level_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: np.ndarray | None,
    gamma: float = 1.0,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A critic-free estimator of `OUTCOME_ESTIMATORS`, verl's function from its registry; (advantages, returns).

    `token_level_rewards`, `mask`: (B, T-1); `group_ids`: (B,) the rollout's groups (same seed), required by the
    group-baseline estimators; `gamma` discounts REINFORCE++'s return-to-go; `norm_by_std` is GRPO's std division.
    """
    if OUTCOME_ESTIMATORS[estimator] and group_ids is None:
        raise ValueError(f"algorithm.adv_estimator={estimator} needs the rollout's group ids")
    if estimator == "grpo":
        return grpo(token_level_rewards, mask, group_ids, norm_by_std)
    extra = {"index": group_ids} if OUTCOME_ESTIMATORS[estimator] else {}
    return core_algos.get_adv_estimator_fn(estimator)(
        token_level_rewards=token_level_rewards, response_mask=mask, config=AlgoConfig(gamma=gamma), **extra
    )


def compute_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    bi_level: bool = False,
    high_level_gamma: float = 1.0,
    estimator: str = "gae",
    group_ids: np.ndarray | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    turns: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (B, T-1): verl's GAE, bi-level GAE when `bi_level`, a critic-free
    estimator of `OUTCOME_ESTIMATORS` (GRPO, RLOO, REINFORCE++, …; no values) over `group_ids`, or `gigpo`
    (gigpo.py), which also reads `turns`: `turn_states`, `turn_rewards` (per trajectory, per turn),
    `step_gamma` and `step_weight`."""
    if estimator == "gigpo":
        if turns is None or group_ids is None:
            raise ValueError("algorithm.adv_estimator=gigpo needs the rollout's group ids, turn states and rewards")
        return gigpo_advantages(token_level_rewards, mask, response_mask, group_ids, turns["turn_states"],
                                turns["turn_rewards"], turns["step_gamma"], turns["step_weight"],
                                norm_adv_by_std_in_grpo)
    if not needs_critic(estimator):
        return outcome_advantages(estimator, token_level_rewards, mask, group_ids, gamma, norm_adv_by_std_in_grpo)
    if bi_level:
        return bi_level_gae(token_level_rewards, values, mask, response_mask, gamma, lam, high_level_gamma)
    return gae(token_level_rewards, values, mask, gamma, lam)

"""RL-health diagnostics of a PPO step (issue 18; how to read them: docs/diagnostics.md).

Rollout diagnostics (train and validation rollouts; no model pass), logged as `train/diag/*` and `val-env/diag/*`:
    format_valid       fraction of assistant turns in the prompted format
    distinct_in_group  distinct trajectories (all their sampled ids) per group / group size, mean over groups
    distinct_batch     distinct trajectories in the whole batch / its size

Batch diagnostics (the filtered training batch, from the old-log-prob pass), logged as `diag/*`:
    entropy/<span>     mean token entropy over the trained positions of each span (token_spans.SPANS) and
                       `entropy/all` over all of them; token_share/<span> is the span's share of those positions,
                       so Σ_span token_share · entropy = entropy/all
    kl_ref             KL(actor ‖ reference) on the trained positions (verl's low_var_kl estimator), with a reference;
                       kl_ref/<span> the same over each span's positions
    mi/*               input dependence of the reasoning every `mi_freq` steps (input_dependence.py)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch
from omegaconf import DictConfig
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F

from SPA_agent.rollout.turns import EnvRecord, turns
from SPA_agent.trainer import input_dependence as dep
from SPA_agent.trainer.token_spans import SPANS, SpanLabeler, token_decoder


def span_entropy_metrics(entropys: torch.Tensor, response_mask: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """`diag/entropy/{all,<span>}` and `diag/token_share/<span>` over the positions of `response_mask`.

    Args:
        entropys: (B, T-1) token entropies (nats) of the old-log-prob pass.
        response_mask: (B, T-1) the trained positions.
        labels: (B, T-1) span index per position (token_spans.SPANS).
    A span without positions gets a share of 0 and no entropy key.
    """
    on = response_mask.bool()
    total = int(on.sum())
    if total == 0:
        return {}
    entropys = entropys.double()
    metrics = {"diag/entropy/all": entropys[on].mean().item()}
    for index, name in enumerate(SPANS):
        span = on & (labels == index)
        count = int(span.sum())
        metrics[f"diag/token_share/{name}"] = count / total
        if count > 0:
            metrics[f"diag/entropy/{name}"] = entropys[span].mean().item()
    return metrics


def distinct_ratios(responses: Sequence[Hashable], group_ids: Sequence[int]) -> dict[str, float]:
    """`diag/distinct_in_group` (mean over groups of distinct / group size) and `diag/distinct_batch`."""
    groups: dict[int, list[Hashable]] = {}
    for response, group in zip(responses, group_ids):
        groups.setdefault(int(group), []).append(response)
    in_group = [len(set(members)) / len(members) for members in groups.values()]
    return {"diag/distinct_in_group": float(np.mean(in_group)),
            "diag/distinct_batch": len(set(responses)) / len(responses)}


def rollout_diagnostics(states: Sequence[EnvRecord]) -> dict[str, float]:
    """Format-valid rate and distinct ratios of a finished rollout (`Rollout.states`, one record per env)."""
    per_state = [turns(state.history) for state in states]
    responses = [tuple(tuple(turn.response_ids) for turn in taken) for taken in per_state]
    metrics = distinct_ratios(responses, [s.group_id for s in states])
    format_ok = [turn.format_ok for taken in per_state for turn in taken]
    if format_ok:
        metrics["diag/format_valid"] = float(np.mean(format_ok))
    return metrics


def span_kl_metrics(old_log_probs: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
                    labels: torch.Tensor) -> dict[str, float]:
    """`diag/kl_ref`: the mean low_var_kl (k3) estimate of KL(actor ‖ reference) over the trained positions, and
    `diag/kl_ref/<span>` the same over each span's positions: where the policy has moved from the reference (in
    add_worldmodel prompts, e.g. whether PPO changes the answers or the written states);
    Σ_span token_share · kl_ref/<span> = kl_ref. (B, T-1) inputs, `labels` as in `span_entropy_metrics`; a span
    without positions gets no key."""
    kl = core_algos.kl_penalty(old_log_probs, ref_log_prob, kl_penalty="low_var_kl")
    metrics = {"diag/kl_ref": verl_F.masked_mean(kl, response_mask).item()}
    kl, on = kl.double(), response_mask.bool()
    for index, name in enumerate(SPANS):
        span = on & (labels == index)
        if span.any():
            metrics[f"diag/kl_ref/{name}"] = kl[span].mean().item()
    return metrics


class Diagnostics:
    """The diagnostics of one run: span labels for its tokenizer and forced prefix, the MI schedule."""

    @classmethod
    def for_proxy(cls, cfg: DictConfig, backend, proxy) -> Diagnostics:
        """For the rollouts of `proxy` (an LLMAgentProxy: its tokenizer, forced prefix and end-of-turn ids)."""
        ctx = proxy.ctx
        return cls(cfg, backend, ctx.tokenizer, ctx.prefix, ctx.chat.stop_ids)

    def __init__(self, cfg: DictConfig, backend, tokenizer, prefix: str, stop_ids: Sequence[int]):
        diag_cfg = cfg.trainer.diagnostics
        self.mi_freq, self.mi_samples = int(diag_cfg.mi_freq), int(diag_cfg.mi_samples)
        self.backend = backend
        self.labeler = SpanLabeler(token_decoder(tokenizer), prefix, stop_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def rollout_metrics(self, rollout) -> dict[str, float]:
        """Format-valid rate and distinct ratios of a finished rollout (agent_proxy.Rollout)."""
        return rollout_diagnostics(rollout.states)

    def step_metrics(self, batch: DataProto, rollout_batch: DataProto, step: int) -> dict[str, float]:
        """Batch diagnostics of the filtered training `batch`, and `diag/mi/*` on the unfiltered rollout batch
        when due. Call after the old-log-prob (and reference) passes and before the actor update."""
        metrics = self.batch_metrics(batch)
        if self.due(step):
            metrics.update(self.input_dependence(rollout_batch, step))
        return metrics

    def batch_metrics(self, batch: DataProto) -> dict[str, float]:
        """Span entropies and KL to the reference of the filtered batch (after the old-log-prob/ref passes)."""
        t = batch.batch
        labels = self.labeler.batch(t["input_ids"], t["assistant_mask"])
        metrics = span_entropy_metrics(t["entropys"], t["response_mask"], labels)
        if "ref_log_prob" in t:
            metrics.update(span_kl_metrics(t["old_log_probs"], t["ref_log_prob"], t["response_mask"], labels))
        return metrics

    def due(self, step: int) -> bool:
        """Whether the input-dependence measure runs at `step` (every mi_freq steps; 0 = never)."""
        return self.mi_freq > 0 and step % self.mi_freq == 0

    @torch.no_grad()
    def input_dependence(self, rollout_batch: DataProto, step: int) -> dict[str, float]:
        """`diag/mi/*` on one trajectory from each of up to `mi_samples` groups of the (unfiltered) rollout
        (trajectories with sampled tokens only). Needs two such groups; with fewer it returns nothing."""
        t = rollout_batch.batch
        sampled = np.flatnonzero(t["response_mask"].sum(-1).numpy() > 0)
        group_ids = np.asarray(rollout_batch.non_tensor_batch["group_ids"])[sampled]
        rows = sampled[dep.sample_rows(group_ids, self.mi_samples, seed=step)].tolist()
        if len(rows) < 2:
            return {}
        labels = self.labeler.batch(t["input_ids"][rows], t["response_mask"][rows])
        pairs = [dep.first_turn(t["input_ids"][row], t["attention_mask"][row], t["response_mask"][row], labels[k])
                 for k, row in enumerate(rows)]
        prompts, reasonings = zip(*pairs)
        scores = dep.score_matrix(self.backend, list(prompts), list(reasonings), self.pad_id)
        return dep.identification_metrics(scores)

"""Does the reasoning depend on the input? RAGEN-style identification of a response's own prompt (issue 18).

For S trajectories from S different groups (different puzzles), take each one's first prompt x_i (everything
before its first sampled token) and its first reasoning r_i (the first turn's sampled tokens up to the end of
its `<think>` block; the whole turn if it has no reasoning or state token). Score every pair:

    L[i, j] = log p(r_i | x_j)        (S × S sequences x_j + r_i through the backend's log-prob pass)

and report
    accuracy  how often the own prompt scores highest (a tie of k prompts counts 1/k); chance is 1/S;
    mi        mean_i [ L[i, i] − log mean_j exp L[i, j] ], an estimate of the mutual information I(x; r) in nats
              between prompt and reasoning; 0 when r does not depend on x, at most log S.

Reasoning that no longer reads its input (template collapse) drives accuracy to chance and mi to 0 even while
entropy stays high. Cost: S² sequences of one prompt and one turn, one forward pass, every `mi_freq` steps.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from verl import DataProto

from SPA_agent.trainer.token_spans import REASONING, STATE, turn_runs

#: log-probs closer than this (nats) count as a tie: identical sequences in differently composed micro-batches
TIE_NATS = 1e-4


def sample_rows(group_ids: np.ndarray, n: int, seed: int) -> list[int]:
    """The first row of each of `n` groups drawn without replacement (all groups when fewer), ascending.
    Uses its own generator: the training run's random state is left untouched."""
    firsts = sorted({int(g): row for row, g in reversed(list(enumerate(group_ids)))}.values())
    if len(firsts) <= n:
        return firsts
    return sorted(np.random.default_rng(seed).choice(firsts, size=n, replace=False).tolist())


def first_turn(input_ids: torch.Tensor, attention_mask: torch.Tensor, assistant_mask: torch.Tensor,
               labels: torch.Tensor) -> tuple[list[int], list[int]]:
    """(prompt ids, reasoning ids) of one row: the tokens before its first sampled token, and that turn's
    sampled tokens up to its last state/reasoning token (the whole turn when it has none).

    Args:
        input_ids, attention_mask: (T,) one left-padded row.
        assistant_mask, labels: (T-1,) its sampled-token mask and span labels (token_spans.SpanLabeler).
    """
    runs = turn_runs(assistant_mask)
    if not runs:
        raise ValueError("a sampled row has no assistant token")
    start, end = runs[0]
    thinking = [k for k in range(start, end) if int(labels[k]) in (STATE, REASONING)]
    stop = thinking[-1] + 1 if thinking else end
    first_real = int(attention_mask.argmax())
    return input_ids[first_real:start + 1].tolist(), input_ids[start + 1:stop + 1].tolist()


def pair_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> DataProto:
    """Left-padded rows `prompts[j] + responses[i]` at row i·S + j, with `response_mask` on the response tokens
    (the (B, T-1) layout of docs/interfaces.md: column c scores token c+1)."""
    rows = [(x, r) for r in responses for x in prompts]
    T = max(len(x) + len(r) for x, r in rows)
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), T, dtype=torch.long)
    response_mask = torch.zeros(len(rows), T - 1)
    for k, (x, r) in enumerate(rows):
        input_ids[k, T - len(x) - len(r):] = torch.tensor(x + r)
        attention_mask[k, T - len(x) - len(r):] = 1
        response_mask[k, T - 1 - len(r):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": attention_mask,
                                        "position_ids": position_ids, "response_mask": response_mask})


def score_matrix(backend, prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> torch.Tensor:
    """(S, S) L[i, j] = log p(responses[i] | prompts[j]) under the actor, via `backend.compute_log_prob`."""
    pairs = pair_batch(prompts, responses, pad_id)
    log_probs = backend.compute_log_prob(pairs).batch["old_log_probs"]
    scores = (log_probs.float() * pairs.batch["response_mask"]).sum(-1)
    return scores.view(len(responses), len(prompts))


def identification_metrics(scores: torch.Tensor) -> dict[str, float]:
    """`diag/mi/accuracy`, `diag/mi/chance` (1/S) and `diag/mi/estimate` (nats) of an (S, S) score matrix
    L[i, j] = log p(r_i | x_j) whose diagonal holds the own prompts."""
    scores = scores.double()
    n = scores.shape[0]
    own = scores.diagonal()
    best = scores.max(dim=1).values
    ties = (scores >= best[:, None] - TIE_NATS).sum(dim=1)
    hit = (own >= best - TIE_NATS).double() / ties
    mi = own - (torch.logsumexp(scores, dim=1) - math.log(n))
    return {"diag/mi/accuracy": hit.mean().item(), "diag/mi/chance": 1.0 / n, "diag/mi/estimate": mi.mean().item()}

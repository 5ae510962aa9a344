"""Where rewards sit and how they are normalized (spec §6.5–§6.6). Pure functions: they return new tensors."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import torch

METHODS = ("identity", "mean", "mean_std", "asym_clip")
STD_EPS = 1e-6
ASYM_CLIP_RANGE = (-1.0, 3.0)


def normalize_scores(scores: torch.Tensor, group_keys: Sequence[Hashable], method: str) -> torch.Tensor:
    """Normalize episode scores (B,) within the groups given by `group_keys` (one key per row).

    identity: unchanged; mean: x − mean; mean_std: (x − mean) / (std + 1e-6), zeros where the group's std
    ≤ 1e-6; asym_clip: mean_std clamped to [−1, 3]. std is the unbiased sample std (0 for a group of one).
    """
    if method not in METHODS:
        raise ValueError(f"reward_normalization.method must be one of {METHODS}, got {method!r}")
    scores = scores.to(torch.float32)
    if method == "identity":
        return scores.clone()
    rows: dict[Hashable, list[int]] = defaultdict(list)
    for i, key in enumerate(group_keys):
        rows[key].append(i)
    out = torch.empty_like(scores)
    for idx in rows.values():
        group = scores[idx]
        centered = group - group.mean()
        if method == "mean":
            out[idx] = centered
            continue
        std = group.std() if len(idx) > 1 else torch.tensor(0.0)
        normalized = torch.zeros_like(group) if std <= STD_EPS else centered / (std + STD_EPS)
        out[idx] = normalized.clamp(*ASYM_CLIP_RANGE) if method == "asym_clip" else normalized
    return out


def turn_ends(response_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: the last position of each run of 1s in `response_mask` (the end of an assistant turn)."""
    on = response_mask.bool()
    next_on = torch.zeros_like(on)
    next_on[:, :-1] = on[:, 1:]
    return on & ~next_on

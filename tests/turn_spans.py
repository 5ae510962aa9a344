"""Assistant turns of a trajectory from its token mask, written apart from the code under test (rewards.turn_ends)."""

from __future__ import annotations

import torch


def turn_spans(mask: torch.Tensor) -> list[torch.Tensor]:
    """The positions of each contiguous run of 1s in a (T,) mask: one run per assistant turn of a trajectory."""
    positions = mask.nonzero().flatten()
    breaks = (positions[1:] != positions[:-1] + 1).nonzero().flatten() + 1
    return list(torch.tensor_split(positions, breaks.tolist()))

"""First-fit-decreasing bin packing of samples by length: how both trainers fill token-budget micro-batches
(SFT's packed plans in sft/packing.py, PPO's `use_dynamic_bsz` plans in SPA_agent/trainer/packing.py)."""

from __future__ import annotations

from collections.abc import Sequence


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of indices with total length <= budget, longest samples placed first; every length must fit the
    budget (the caller names its own config key when one does not)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((b for b, load in enumerate(loads) if load + lengths[index] <= budget), None)
        if slot is None:
            bins.append([])
            loads.append(0)
            slot = len(bins) - 1
        bins[slot].append(index)
        loads[slot] += lengths[index]
    return bins

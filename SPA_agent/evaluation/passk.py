"""Pass@k estimators over puzzles with several samples each (spec §11, DESIGN §2 "Evaluation is honest").

Notation: a puzzle was attempted n times and solved c times.
- `pass_at_k(n, c, k)` — the unbiased estimator 1 − C(n−c, k) / C(n, k) of "at least one of k fresh samples
  solves it" (Chen et al., 2021), averaged over puzzles by `mean_pass_at_k`.
- `pass_any(n, c)` — the original RAGEN metric `<Tag>/pass@<G>`: 1 if any of the n samples solved it. It equals
  pass_at_k at k = n, and is reported under its own name (`pass_any@n`).
- `bootstrap_ci` — percentile bootstrap 95% interval of the mean over puzzles (resampling puzzles).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one puzzle with c successes out of n samples; needs 1 ≤ k ≤ n and 0 ≤ c ≤ n."""
    if not 0 <= c <= n:
        raise ValueError(f"successes c={c} must lie in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must lie in [1, n={n}]: raise evaluation.n or lower evaluation.k")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_any(n: int, c: int) -> float:
    """1.0 if any of the n samples succeeded (the original any-of-n metric)."""
    return float(c > 0)


def per_puzzle_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> np.ndarray:
    """pass@k of each puzzle; `counts` holds one (n, c) pair per puzzle. Returns shape (P,)."""
    return np.array([pass_at_k(n, c, k) for n, c in counts], dtype=np.float64)


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """Mean unbiased pass@k over puzzles."""
    return float(per_puzzle_pass_at_k(counts, k).mean())


def bootstrap_ci(
    values: Sequence[float], num_resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (one value per puzzle, shape (P,)).

    Puzzles are resampled with replacement `num_resamples` times with a seeded numpy Generator, so the
    interval is reproducible. A single puzzle gives a zero-width interval at its value.
    """
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("bootstrap_ci needs at least one puzzle")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, data.size, size=(num_resamples, data.size))
    means = data[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


def passk_summary(
    counts: Sequence[tuple[int, int]], ks: Sequence[int], num_resamples: int = 2000, seed: int = 0
) -> dict[str, float]:
    """pass@k with its bootstrap 95% interval for every k, plus success (pass@1 mean) and pass_any@n.

    Keys: `pass@<k>`, `pass@<k>_ci_low`, `pass@<k>_ci_high`, `pass_any@<n>` (n = the smallest sample count
    over puzzles), `num_puzzles`, `num_samples`.
    """
    if not counts:
        raise ValueError("no puzzles to summarize")
    n_min = min(n for n, _ in counts)
    summary: dict[str, float] = {"num_puzzles": len(counts), "num_samples": sum(n for n, _ in counts)}
    for k in ks:
        values = per_puzzle_pass_at_k(counts, k)
        low, high = bootstrap_ci(values, num_resamples=num_resamples, seed=seed)
        summary.update({f"pass@{k}": float(values.mean()), f"pass@{k}_ci_low": low, f"pass@{k}_ci_high": high})
    summary[f"pass_any@{n_min}"] = float(np.mean([pass_any(n, c) for n, c in counts]))
    return summary

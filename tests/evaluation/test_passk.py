"""Pass@k estimator against exact enumeration; bootstrap interval coverage in a seeded simulation."""

from __future__ import annotations

from itertools import combinations, pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SPA_agent.evaluation.passk import bootstrap_ci, mean_pass_at_k, pass_any, pass_at_k, passk_summary


def enumerated_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (c of them successes) that contain a success."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_estimator_equals_exact_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(enumerated_pass_at_k(n, c, k), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_1_is_success_rate_and_grows_with_k(nc):
    n, c = nc
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert all(a <= b + 1e-12 for a, b in pairwise(values))
    assert values[-1] == pass_any(n, c)


def test_known_vector():
    # n=8, c=2, k=4: 1 - C(6,4)/C(8,4) = 1 - 15/70
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)
    assert mean_pass_at_k([(8, 0), (8, 8)], 3) == pytest.approx(0.5)


def test_k_larger_than_n_is_a_clear_error():
    with pytest.raises(ValueError, match="evaluation.n"):
        pass_at_k(2, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_bootstrap_interval_covers_truth_in_simulation():
    """Puzzles with latent solve rates p ~ Beta(1, 2), 8 samples each; the 95% interval of mean pass@4
    over 80 puzzles should cover the true expected pass@4 in most of 60 seeded repetitions."""
    rng = np.random.default_rng(1234)
    n, k, num_puzzles, reps = 8, 4, 80, 60
    true_value = 1 - np.mean((1 - rng.beta(1, 2, size=400_000)) ** k)
    covered = 0
    for rep in range(reps):
        p = rng.beta(1, 2, size=num_puzzles)
        counts = rng.binomial(n, p)
        values = [pass_at_k(n, int(c), k) for c in counts]
        low, high = bootstrap_ci(values, num_resamples=500, seed=rep)
        covered += low <= true_value <= high
    assert covered / reps >= 0.85


def test_bootstrap_is_seeded_and_degenerate_cases():
    values = [0.0, 1.0, 0.5, 0.25]
    assert bootstrap_ci(values, seed=3) == bootstrap_ci(values, seed=3)
    assert bootstrap_ci([0.7]) == (pytest.approx(0.7), pytest.approx(0.7))
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_summary_keys_and_values():
    summary = passk_summary([(4, 0), (4, 1), (4, 4)], ks=[1, 4], num_resamples=200)
    assert summary["pass@1"] == pytest.approx((0 + 0.25 + 1) / 3)
    assert summary["pass@4"] == pytest.approx(2 / 3)
    assert summary["pass_any@4"] == pytest.approx(2 / 3)
    assert summary["pass@1_ci_low"] <= summary["pass@1"] <= summary["pass@1_ci_high"]
    assert summary["num_puzzles"] == 3 and summary["num_samples"] == 12

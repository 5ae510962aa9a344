"""Validation curves with bootstrap intervals over episodes (SPA_agent/evaluation/learning_curves.py) and their plot."""

from __future__ import annotations

import json

import pytest

from SPA_agent.evaluation.learning_curves import (
    curve_from_records,
    episode_interval,
    intervals_overlap,
    load_curve,
)
from SPA_agent.evaluation.plots import plot_arms


def test_interval_is_degenerate_at_zero_and_one_and_near_the_normal_one_in_between():
    assert episode_interval(0.0, 256) == (0.0, 0.0)
    assert episode_interval(1.0, 256) == (1.0, 1.0)
    low, high = episode_interval(64 / 256, 256, num_resamples=4000)
    # Normal approximation: 0.25 ± 1.96·sqrt(0.25·0.75/256) = [0.197, 0.303]; percentile steps are 1/256.
    assert low == pytest.approx(0.197, abs=0.008) and high == pytest.approx(0.303, abs=0.008)
    assert episode_interval(39 / 256, 256) == episode_interval(39 / 256, 256)  # seeded


def test_a_success_that_is_no_count_of_the_episodes_is_refused():
    with pytest.raises(ValueError, match="not a count out of 256"):
        episode_interval(0.1, 256)  # 25.6 successes
    with pytest.raises(ValueError, match="at least one episode"):
        episode_interval(0.0, 0)


RECORDS = [
    {"step": 0, "val-env/SimpleSokoban/success": 0.25},
    {"step": 1, "actor/entropy": 0.9, "val-env/SimpleSokoban/success": 0.0},  # superseded by the rerun below
    {"step": 1, "actor/entropy": 0.8},
    {"step": 2, "actor/entropy": 0.5, "val-env/SimpleSokoban/success": 1.0},
]


def test_curve_has_one_point_per_validation_step_and_the_entropy_per_step():
    curve = curve_from_records(RECORDS, episodes=4, num_resamples=200)
    assert curve.tag == "SimpleSokoban" and curve.episodes == 4
    assert [(p.step, p.success) for p in curve.points] == [(0, 0.25), (2, 1.0)]
    assert (curve.points[1].low, curve.points[1].high) == (1.0, 1.0)
    assert curve.entropy == [(1, 0.8), (2, 0.5)]
    assert curve.last_step == 2
    assert not intervals_overlap(curve.points[0], curve.points[1])  # [0, 0.75] vs [1, 1]


def test_load_curve_counts_the_episodes_of_the_runs_validation(tmp_path):
    (tmp_path / "config.yaml").write_text(
        "es_manager:\n  val:\n    env_groups: 2\n    group_size: 2\ntrainer:\n  validation_steps: 1\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    curve = load_curve(tmp_path, num_resamples=200)
    assert curve.episodes == 4 and len(curve.points) == 2
    assert plot_arms({"a": curve, "b": curve}, tmp_path / "arms.png").stat().st_size > 1000

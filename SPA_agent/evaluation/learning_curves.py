"""Validation learning curves of a PPO run with 95% bootstrap intervals over episodes (issue 13's arms).

A PPO run logs, at each validation step, `val-env/<Tag>/success`: the mean over the episodes of its validation
rollouts (es_manager.val.env_groups × group_size episodes, repeated trainer.validation_steps times). An episode
either succeeds or not, so the number of successes is that mean × the number of episodes, and a bootstrap over
episodes depends on nothing else: the interval is computed from the count (`episode_interval`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from SPA_agent.evaluation.passk import bootstrap_ci
from SPA_agent.runs.metrics_file import read_records

SUCCESS_KEY = re.compile(r"^val-env/(?P<tag>[^/]+)/success$")
ENTROPY_KEY = "actor/entropy"


def episode_interval(success: float, episodes: int, num_resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the success rate over `episodes` binary episodes whose mean is
    `success` (resampling episodes)."""
    if episodes < 1:
        raise ValueError(f"episode_interval needs at least one episode, got {episodes}")
    successes = round(success * episodes)
    if abs(successes - success * episodes) > 1e-6 * episodes:
        raise ValueError(f"success {success} is not a count out of {episodes} episodes: is the episode count right?")
    values = np.zeros(episodes)
    values[:successes] = 1.0
    return bootstrap_ci(values, num_resamples=num_resamples, seed=seed)


def validation_episodes(run_config: Mapping) -> int:
    """Episodes behind one logged validation success of a PPO run (its composed config.yaml)."""
    val = run_config["es_manager"]["val"]
    return int(val["env_groups"]) * int(val["group_size"]) * int(run_config["trainer"]["validation_steps"])


@dataclass
class CurvePoint:
    """Validation success at one PPO step (0 = before the first update) with its 95% interval."""

    step: int
    success: float
    low: float
    high: float


@dataclass
class Curve:
    """What one PPO run logged: validation success with intervals, and the actor entropy per step."""

    tag: str
    episodes: int
    points: list[CurvePoint] = field(default_factory=list)
    entropy: list[tuple[int, float]] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        return max([p.step for p in self.points] + [s for s, _ in self.entropy], default=0)


def curve_from_records(records: list[Mapping], episodes: int, num_resamples: int = 2000) -> Curve:
    """The curve of metrics.jsonl records (the last record of a step wins); the single env tag of the validation
    keys names it."""
    tags = sorted({m["tag"] for r in records for key in r if (m := SUCCESS_KEY.match(key))})
    if len(tags) > 1:
        raise ValueError(f"validation of several env tags {tags}: one curve per tag is not implemented")
    curve = Curve(tag=tags[0] if tags else "", episodes=episodes)
    by_step = {int(r["step"]): r for r in records}  # a run restarted before its first checkpoint logs steps again
    for record in sorted(by_step.values(), key=lambda r: int(r["step"])):
        success = record.get(f"val-env/{curve.tag}/success")
        if success is not None:
            low, high = episode_interval(success, episodes, num_resamples)
            curve.points.append(CurvePoint(int(record["step"]), float(success), low, high))
        if ENTROPY_KEY in record:
            curve.entropy.append((int(record["step"]), float(record[ENTROPY_KEY])))
    return curve


def load_curve(run_dir: Path, num_resamples: int = 2000) -> Curve:
    """The curve of the PPO run in `run_dir` (its metrics.jsonl and config.yaml)."""
    run_dir = Path(run_dir)
    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    records, _ = read_records(run_dir / "metrics.jsonl")
    return curve_from_records(records, validation_episodes(config), num_resamples)


def intervals_overlap(a: CurvePoint, b: CurvePoint) -> bool:
    return a.low <= b.high and b.low <= a.high

"""Validation trajectories as text: `<output_dir>/val_generations.jsonl` (`trainer.log_val_generations`).

The metrics say how often the model succeeds and how long it writes; these lines say what it writes. At every
validation the PPO trainer appends one line for the first trajectory of each of the first `count` groups (one puzzle
each, the same puzzles every time: the validation seeds are fixed), so a run's lines show one puzzle's answers change
over training. A line is the evaluation's trajectories.jsonl record (evaluation/evaluate.py `trajectory_record`: the
chat with the raw responses, actions, rewards, true states, metrics) with the validation's `step` first, so one
reader serves both files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from SPA_agent.evaluation.evaluate import trajectory_record
from SPA_agent.rollout.turns import EnvRecord
from SPA_agent.runs.metrics_file import truncate_after

GENERATIONS_FILE = "val_generations.jsonl"


def first_of_each_group(states: Sequence[EnvRecord], count: int) -> list[EnvRecord]:
    """The lowest-env_id trajectory of each of the `count` lowest group ids."""
    firsts: dict[int, EnvRecord] = {}
    for record in sorted(states, key=lambda r: r.env_id):
        firsts.setdefault(record.group_id, record)
    return [firsts[group] for group in sorted(firsts)[:count]]


class GenerationsLog:
    """Appends the chosen validation trajectories of each validation to `<output_dir>/val_generations.jsonl`."""

    def __init__(self, output_dir: str | Path, count: int):
        self.path = Path(output_dir) / GENERATIONS_FILE
        self.count = count

    def log(self, step: int, proxy, states: Sequence[EnvRecord]) -> None:
        """`proxy`: the agent proxy that ran the rollout (its chats of the trajectories)."""
        if self.count <= 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for record in first_of_each_group(states, self.count):
                line = {"step": step, **trajectory_record(proxy, record, repeat=0, failed=False)}
                f.write(json.dumps(line) + "\n")
            f.flush()

    def truncate_after(self, step: int) -> None:
        """Drop the lines of steps after `step` (a resumed run validates them again) and a cut-short last line."""
        truncate_after(self.path, step)

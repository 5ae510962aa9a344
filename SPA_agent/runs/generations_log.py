"""Validation trajectories as text: `<output_dir>/val_generations.jsonl` (`trainer.log_val_generations`).

The metrics say how often the model succeeds and how long it writes; these lines say what it writes. At every
validation the PPO trainer appends one JSON line for the first trajectory of each of the first `count` groups (one
puzzle each, the same puzzles every time: the validation seeds are fixed), so a run's lines show one puzzle's answers
change over training:

    {"step": 25, "group_id": 0, "env_id": 0, "seed": 1000, "tag": "SimpleSokoban", "metrics": {...},
     "penalty": 0.0, "turns": [{"state": ..., "response": ..., "actions": [...], "reward": ..., "format_ok": ...}],
     "final_state": ...}

`response` is what the model produced (its raw text, a forced prefix included); `state` the render it was shown.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from SPA_agent.rollout.turns import EnvRecord, read_entry, turns
from SPA_agent.runs.atomic_io import write_jsonl
from SPA_agent.runs.metrics_file import read_records

GENERATIONS_FILE = "val_generations.jsonl"


def trajectory_record(step: int, record: EnvRecord) -> dict:
    """One finished trajectory as a JSON-ready dict: its turns' shown states, responses, actions and rewards."""
    return {
        "step": step, "group_id": record.group_id, "env_id": record.env_id, "seed": record.seed, "tag": record.tag,
        "metrics": dict(record.metrics), "penalty": record.penalty,
        "turns": [{"state": turn.state, "response": turn.llm_raw_response, "actions": list(turn.actions),
                   "reward": turn.reward, "format_ok": turn.format_ok} for turn in turns(record.history)],
        "final_state": read_entry(record.history[-1]).state,
    }


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

    def log(self, step: int, states: Sequence[EnvRecord]) -> None:
        if self.count <= 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for record in first_of_each_group(states, self.count):
                f.write(json.dumps(trajectory_record(step, record)) + "\n")
            f.flush()

    def truncate_after(self, step: int) -> None:
        """Drop the lines of steps after `step` (a resumed run validates them again) and a cut-short last line."""
        records, intact = read_records(self.path)
        if not intact or any(r["step"] > step for r in records):
            write_jsonl(self.path, [r for r in records if r["step"] <= step])

"""The data card of a self-play SFT dataset (data_card.json + data_card.md): provenance, counts, the generating
policy's success rate, how often it answered in the world-model format, and the accuracy of its own imagined
states before ground-truth substitution (the paper's "self-belief" signal, Table 3)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from omegaconf import DictConfig

from SPA_agent.generators import ACTION_SOURCES
from SPA_agent.rollout.turns import EnvRecord, transitions
from SPA_agent.runs.dir_lock import check_unlocked
from SPA_agent.runs.run_identity import file_checksum
from SPA_agent.selfplay.worldmodel import ACCURACY_KEYS, extract_states, has_worldmodel_format, turn_accuracy
from SPA_agent.stages import CARD_FILE, SPLITS  # CARD_FILE: written last, marks a complete dataset

PARTIAL_DIR = ".partial"  # batch shards of an unfinished generation


def check_dataset_complete(data_file: Path) -> None:
    """Raise ValueError unless the directory of `data_file` holds a complete dataset: its data card, no
    unfinished generation (`.partial/`), no live writer, and `data_file` as the card describes it."""
    directory = Path(data_file).parent
    check_unlocked(directory)
    if (directory / PARTIAL_DIR).is_dir():
        raise ValueError(f"{directory} has an unfinished data generation ({PARTIAL_DIR}/): rerun stage 1 with the "
                         f"same settings to finish it, or delete {directory / PARTIAL_DIR} to use the dataset as it is")
    if not (directory / CARD_FILE).is_file():
        raise ValueError(f"{directory} has no {CARD_FILE}, so it is not a complete stage-1 dataset (interrupted or "
                         "failed?): rerun stage 1, or set data.require_data_card=false for data made elsewhere")
    check_dataset_files(data_file)


def describe_files(directory: Path, names: Iterable[str]) -> dict[str, dict]:
    """The card's record of the data files it describes: rows and checksum of each (`card["files"]`)."""
    return {name: {"rows": pq.read_metadata(Path(directory) / name).num_rows,
                   "sha256": file_checksum(Path(directory) / name)} for name in names}


def _recorded_rows(card: Mapping, name: str) -> int | None:
    """Rows of data file `name` by a card written before cards recorded their files (None when it does not say):
    stage 1's num_train/num_val, the filter script's kept rows, spa_arms' data without world model."""
    split = Path(name).stem
    counts = dict(zip(SPLITS, (card.get("num_train"), card.get("num_val")), strict=True))
    if isinstance(card.get("splits"), Mapping):
        counts |= {key: (value or {}).get("kept") for key, value in card["splits"].items()}
    if isinstance(card.get("rows"), Mapping):
        counts |= card["rows"]
    return counts.get(split)


def check_dataset_files(data_file: Path) -> None:
    """Raise ValueError unless `data_file` is the file its data card describes: same checksum (cards that record
    `files`), else, for older cards, the same number of rows and only the card's env tags. A file replaced by
    another dataset's (FrozenLake rows under a Sokoban card) would otherwise train without a word."""
    data_file = Path(data_file)
    card = json.loads((data_file.parent / CARD_FILE).read_text(encoding="utf-8"))
    redo = (f"regenerate the dataset (stage 1), or set data.require_data_card=false to train on "
            f"{data_file.parent} as it is")
    recorded = (card.get("files") or {}).get(data_file.name)
    rows = pq.read_metadata(data_file).num_rows
    if recorded is not None:
        if file_checksum(data_file) != recorded["sha256"]:
            raise ValueError(f"{data_file} is not the file its {CARD_FILE} describes ({rows} rows, the card "
                             f"{recorded['rows']}; the checksum differs): replaced or edited after it was made? {redo}")
        return
    expected = _recorded_rows(card, data_file.name)
    if expected is not None and rows != expected:
        raise ValueError(f"{data_file} has {rows} rows but its {CARD_FILE} says {expected}: replaced or edited after "
                         f"it was made? {redo}")
    tags = card.get("env_tags")
    if tags and "env_tag" in pq.read_schema(data_file).names:
        found = set(pq.read_table(data_file, columns=["env_tag"]).column("env_tag").to_pylist())
        if not found <= set(tags):
            raise ValueError(f"{data_file} holds rows of {sorted(found - set(tags))} but its {CARD_FILE} describes "
                             f"{tags}: replaced after it was made? {redo}")


def check_dataset_config(data_file: Path, config_name: str) -> None:
    """Raise ValueError when the data card beside `data_file` (or, for filtered data, its source's card) names
    another entry config than `config_name`: FrozenLake rows would train a Sokoban run without a word."""
    from SPA_agent.runs.atomic_io import read_json

    directory = Path(data_file).parent
    card = read_json(directory / CARD_FILE, "rerun stage 1, or pass data.config_name=null to skip this check")
    made_by = card.get("config_name") or (card.get("source_card") or {}).get("config_name")
    if made_by is not None and made_by != config_name:
        raise ValueError(f"{directory} holds {made_by} data ({CARD_FILE}) but this run is for {config_name}: pass "
                         f"the {config_name} data, or data.config_name=null to train on it anyway")


@dataclass
class BatchStats:
    """Counts over trajectories and assistant turns; `accuracy_sums[key]` / `accuracy_counts[key]` is the mean
    self-belief accuracy over the turns that had a state block."""

    trajectories: int = 0
    successes: int = 0
    turns: int = 0
    turns_worldmodel_format: int = 0
    turns_with_states: int = 0
    turns_filter_pass: int = 0
    seeds: list[int] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    accuracy_sums: dict[str, float] = field(default_factory=dict)
    accuracy_counts: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> BatchStats:
        return cls(**data)

    @classmethod
    def merge(cls, parts: Iterable[BatchStats]) -> BatchStats:
        total = cls()
        for part in parts:
            for name in ("trajectories", "successes", "turns", "turns_worldmodel_format", "turns_with_states",
                         "turns_filter_pass"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            total.seeds = sorted(set(total.seeds) | set(part.seeds))
            total.tags = sorted(set(total.tags) | set(part.tags))
            for key, value in part.accuracy_sums.items():
                total.accuracy_sums[key] = total.accuracy_sums.get(key, 0.0) + value
                total.accuracy_counts[key] = total.accuracy_counts.get(key, 0) + part.accuracy_counts[key]
        return total

    def add_turn(self, response: str, format_ok: bool, before: str, after: str) -> None:
        self.turns += 1
        self.turns_worldmodel_format += bool(format_ok)
        self.turns_with_states += any(extract_states(response))
        self.turns_filter_pass += has_worldmodel_format(response)
        for key, value in (turn_accuracy(response, before, after) or {}).items():
            if value is not None:
                self.accuracy_sums[key] = self.accuracy_sums.get(key, 0.0) + value
                self.accuracy_counts[key] = self.accuracy_counts.get(key, 0) + 1

    def card(self, cfg: DictConfig, generator_stats: Mapping[str, int] | None = None,
             **counts: int) -> dict[str, Any]:
        """The data card as a JSON-ready dict; `counts` are the split sizes (rows and trajectories) and
        `generator_stats` the generator's own counts (the solver's planned and fallback turns), when it keeps any."""
        return {
            "stage": "self-play SFT data (spec §8)",
            "config_name": cfg.config_name,
            "generator": cfg.generator.name,
            "action_source": ACTION_SOURCES.get(cfg.generator.name, "model"),
            "model_path": str(cfg.model_path),
            "model_size": str(cfg.get("model_size", "")),
            "render_mode": cfg.render_mode,
            "prompt_mode": cfg.data_gen.prompt_mode,
            "env_tags": self.tags,
            "num_batches": cfg.data_gen.num_batches,
            "seeds": {"first": min(self.seeds, default=None), "last": max(self.seeds, default=None),
                      "distinct_puzzles": len(self.seeds)},
            "temperature": cfg.actor_rollout_ref.rollout.temperature,
            "max_new_tokens": cfg.actor_rollout_ref.rollout.response_length,
            "split": {"by": cfg.data_gen.split_by, "val_fraction": cfg.data_gen.val_fraction,
                      "seed": cfg.data_gen.split_seed},
            "state_targets": cfg.data_gen.state_targets,
            "format_filter": bool(cfg.data_gen.format_filter),
            "num_trajectories": self.trajectories,
            "num_rows": self.turns,
            **counts,
            "num_rows_passing_format_filter": self.turns_filter_pass,
            "num_rows_without_state_tags": self.turns - self.turns_with_states,
            "success_rate": _rate(self.successes, self.trajectories),
            **({"generator_stats": dict(generator_stats)} if generator_stats is not None else {}),
            "worldmodel_format_rate": _rate(self.turns_worldmodel_format, self.turns),
            "self_belief_accuracy": {
                key: _rate(self.accuracy_sums.get(key, 0.0), self.accuracy_counts.get(key, 0))
                for key in ACCURACY_KEYS
            },
        }


def trajectory_stats(states: list[EnvRecord]) -> BatchStats:
    """Stats of one rollout's states (`Rollout.states`); self-belief is scored on the normalized responses."""
    stats = BatchStats()
    for record in states:
        stats.trajectories += 1
        stats.successes += int(record.metrics[f"{record.tag}/success"] > 0)
        stats.seeds = sorted(set(stats.seeds) | {int(record.seed)})
        stats.tags = sorted(set(stats.tags) | {record.tag})
        for turn, after in transitions(record.history):
            stats.add_turn(turn.llm_response, turn.format_ok, turn.state, after)
    return stats


def _rate(num: float, den: float) -> float | None:
    return num / den if den else None


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def render_data_card(card: Mapping[str, Any]) -> str:
    """Markdown view of the card."""
    lines = [f"# Data card: {card['config_name']} ({card['generator']}, {card['model_path']})", "",
             "| field | value |", "|---|---|"]
    for key, value in card.items():
        if isinstance(value, Mapping):
            value = ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(map(str, value))
        lines.append(f"| {key} | {_fmt(value)} |")
    lines += ["", ("`action_source`: what chose the actions: `model` (the model's own answers), `random` (uniform "
                   "random actions, the floor) or `solver` (a shortest-path solver on the true state, the expert "
                   "ceiling)."),
              ("`self_belief_accuracy`: the model's own <observation>/<prediction> contents against the true "
                   "states, before substitution (exact match, per-cell, coordinate sentence), over turns that had the "
                   "block."),
              ("`state_targets`: what the model's <observation>/<prediction> blocks hold: `ground_truth` (the environment's "
               "states, SPA), `self_belief` (the model's own, no substitution) or `random_coordinates` (true grids, "
               "i.i.d. random coordinates). `format_filter`: true = only rows whose response has <think> with "
               "<observation> before <prediction>, before <answer> were kept (num_train/num_val count them; "
               "num_rows_before_format_filter all rows), as in the released FrozenLake and Sudoku data.")]
    return "\n".join(lines) + "\n"

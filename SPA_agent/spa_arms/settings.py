"""The settings of a three-arm experiment, recorded in DIR/settings.json by its first run: the arms, the defaults,
what may change between runs into the same directory and what an experiment --from DIR takes from there."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ARMS = {
    "spa": ("data", "paper", "(a) SPA: world-model SFT, loss_target=paper"),
    "nowm": ("data_nowm", "paper", "(b) no world model: same trajectories, base format"),
    "released": ("data", "released", "(c) loss_target=released"),
}
#: settings that may change between runs into the same directory (the PPO runs continue to more steps; arms may
#: be added, they share the data)
MUTABLE = ("ppo_steps", "arms", "max_parallel", "devices")
#: settings that DIR's data and SFT were made with: an experiment --from DIR takes them from there, never others
FROM_SETTINGS = ("config", "model", "data_batches", "sft_epochs", "sft_lr", "sft_save_freq", "overrides",
                 "data_overrides", "sft_overrides")


class StageError(Exception):
    """A stage that cannot run or whose processes failed: printed as one line."""


HELP = {
    "config": "entry config", "model": "model preset: small, or tiny for CPU checks",
    "data_batches": "self-play batches (es_manager.train: 32 × 8 trajectories each)",
    "sft_epochs": "SFT epochs", "sft_lr": "SFT learning rate", "sft_save_freq": "SFT checkpoint interval (steps)",
    "ppo_steps": "PPO steps per arm", "test_freq": "PPO validation interval (steps)",
    "save_freq": "PPO checkpoint interval (steps)", "val_groups": "validation puzzles of PPO",
    "val_group_size": "samples per validation puzzle", "wm_puzzles": "puzzles of the world-model evaluations",
    "arms": "arms to run", "overrides": "Hydra overrides of data, PPO and evaluation (one quoted string)",
    "data_overrides": "Hydra overrides of the data stage", "sft_overrides": "Hydra overrides of SFT",
    "ppo_overrides": "Hydra overrides of PPO", "eval_overrides": "Hydra overrides of the evaluations",
    "max_parallel": "processes at a time within a stage", "devices": "comma-separated GPU ids to spread processes over",
    "from_dir": "experiment directory whose data and SFT checkpoints this one links and starts PPO from",
}


@dataclass
class Settings:
    config: str = "_2_sokoban"
    model: str = "small"
    data_batches: int = 12
    sft_epochs: int = 2
    sft_lr: float = 5e-4
    sft_save_freq: int = 200
    ppo_steps: int = 150
    test_freq: int = 10
    save_freq: int = 25
    val_groups: int = 128
    val_group_size: int = 2
    wm_puzzles: int = 128
    arms: tuple[str, ...] = tuple(ARMS)
    overrides: str = ""
    data_overrides: str = ""
    #: one padded micro-batch of the 16 rows and no flex-attention compile (the small model: 1,104 steps, 2 epochs,
    #: in about 2 minutes on an H200)
    sft_overrides: str = "data.packing=false data.micro_batch_size_per_gpu=16 model.attn_implementation=sdpa"
    ppo_overrides: str = ""
    eval_overrides: str = ""
    max_parallel: int = 3
    devices: str = ""
    from_dir: str = ""


#: the least value of each integer setting (a 0 would start the data and SFT stages, then fail or do nothing)
MINIMA = {"data_batches": 1, "sft_epochs": 1, "sft_save_freq": 1, "ppo_steps": 1, "test_freq": 1, "save_freq": 1,
          "val_groups": 1, "val_group_size": 1, "wm_puzzles": 1, "max_parallel": 1}


def check_settings(settings: Settings) -> None:
    """Raise StageError naming the command-line flag of the first setting out of range, before any stage runs."""
    for name, low in MINIMA.items():
        if getattr(settings, name) < low:
            raise StageError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(settings, name)}")
    if not settings.sft_lr > 0:
        raise StageError(f"--sft-lr must be > 0, got {settings.sft_lr}")
    if any(not d.strip().isdigit() for d in settings.devices.split(",") if settings.devices):
        raise StageError(f"--devices takes comma-separated GPU ids such as 0,1, got {settings.devices!r}")


def read_settings(directory: Path) -> dict:
    """settings.json of an experiment directory, {} where there is none."""
    path = directory / "settings.json"
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    if "arms" in recorded:
        recorded["arms"] = tuple(recorded["arms"])
    return recorded


def changed_settings(recorded: Mapping, given: Mapping, keys: tuple[str, ...]) -> list[str]:
    """'key (recorded -> given)' for each of `keys` given (not None) with a value other than the recorded one."""
    return [f"{k} ({recorded[k]!r} -> {given[k]!r})" for k in keys
            if given.get(k) is not None and k in recorded and recorded[k] != given[k]]


def source_settings(out: Path, given: Mapping) -> dict:
    """The settings a new experiment --from DIR starts from: DIR's; {} without --from. Refused where DIR is no
    experiment directory or where an option given differs from what DIR's data and SFT were made with."""
    if not given.get("from_dir"):
        return {}
    source = (out / given["from_dir"]).resolve()
    recorded = read_settings(source)
    if not recorded:
        raise StageError(f"--from {source}: no settings.json there, not an experiment directory of this script")
    changed = changed_settings(recorded, given, FROM_SETTINGS)
    if changed:
        raise StageError(f"--from {source}: its data and SFT were made with other settings: {', '.join(changed)}. "
                         "Drop those options (they are taken from there)")
    return recorded


def load_settings(out: Path, given: Mapping) -> Settings:
    """The recorded settings of `out` (for a new experiment --from DIR: DIR's) updated by the options given on the
    command line (None = not given); a given option that differs from the recorded one is refused, except those
    in MUTABLE."""
    recorded = read_settings(out)
    changed = changed_settings(recorded, given, tuple(k for k in given if k not in MUTABLE))
    if changed:
        raise StageError(f"{out} holds an experiment made with other settings: {', '.join(changed)}. "
                         "Use another --out, or drop those options")
    base = recorded or source_settings(out, given)
    return Settings(**{**base, **{k: v for k, v in given.items() if v is not None}})

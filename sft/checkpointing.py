"""Checkpoint layout, atomic saves, resume lookup and retention for the SFT trainer.

    <default_local_dir>/global_step_N/          Hugging Face directory: config, weights, tokenizer
    <default_local_dir>/global_step_N/train_state/
        trainer_state.json   global step, epoch, step in epoch, end-of-epoch flag
        optimizer.pt         full (unsharded) optimizer state
        scheduler.pt         LR scheduler state
        adapter.pt           trainable (LoRA) weights, only when LoRA is on (the HF weights are merged)
        rng_rank<r>.pt       each rank's torch RNG state

A checkpoint is written into `.global_step_N.tmp/` and renamed when complete, so a killed run never leaves a
directory that looks complete. Resume picks the newest `global_step_N` that still has `train_state/`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

STEP_DIR = re.compile(r"^global_step_(\d+)$")
TRAIN_STATE = "train_state"
STATE_FILE = "trainer_state.json"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def staging_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".global_step_{step}.tmp"


def checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """All complete `global_step_N` directories under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def latest_resumable(root: str | Path) -> Path | None:
    """Newest checkpoint that holds training state, or None."""
    resumable = [p for _, p in checkpoints(root) if (p / TRAIN_STATE / STATE_FILE).is_file()]
    return resumable[-1] if resumable else None


def write_state(directory: Path, state: dict) -> None:
    (directory / TRAIN_STATE).mkdir(parents=True, exist_ok=True)
    (directory / TRAIN_STATE / STATE_FILE).write_text(json.dumps(state, indent=2))


def read_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / TRAIN_STATE / STATE_FILE).read_text())


def publish(root: str | Path, step: int) -> Path:
    """Rename the finished staging directory to `global_step_<step>` (replacing an older one of that name)."""
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    staging_dir(root, step).rename(final)
    return final


def prune(root: str | Path, max_to_keep: int | None) -> None:
    """Keep the newest `max_to_keep` checkpoints whole. Older ones lose their training state; their Hugging Face
    weights stay only if they closed an epoch (mid-epoch ones are removed). None keeps everything."""
    if max_to_keep is None:
        return
    if max_to_keep < 1:
        raise ValueError(f"trainer.max_ckpt_to_keep must be >= 1 or null, got {max_to_keep}")
    for _, path in checkpoints(root)[:-max_to_keep]:
        state_dir = path / TRAIN_STATE
        if not state_dir.exists():
            continue
        end_of_epoch = json.loads((state_dir / STATE_FILE).read_text()).get("end_of_epoch", False)
        shutil.rmtree(state_dir if end_of_epoch else path)


def clean_staging(root: str | Path) -> None:
    """Remove staging directories a killed run left behind."""
    for path in Path(root).glob(".global_step_*.tmp") if Path(root).is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)

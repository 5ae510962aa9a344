"""What an SFT checkpoint holds, resume lookup and retention (the directories: SPA_agent/runs/checkpoint_dirs.py).

    <default_local_dir>/global_step_N/          Hugging Face directory: config, weights, tokenizer
    <default_local_dir>/global_step_N/train_state/
        trainer_state.json   global step, epoch, step in epoch, end-of-epoch flag
        optimizer.pt         full (unsharded) optimizer state
        scheduler.pt         LR scheduler state
        adapter.pt           trainable (LoRA) weights, only when LoRA is on (the HF weights are merged)
        rng_rank<r>.pt       each rank's torch RNG state

Resume picks the newest `global_step_N` that still has `train_state/`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from SPA_agent.runs.atomic_io import read_json
from SPA_agent.runs.checkpoint_dirs import checkpoints

TRAIN_STATE = "train_state"
STATE_FILE = "trainer_state.json"


def latest_resumable(root: str | Path) -> Path | None:
    """Newest checkpoint that holds training state, or None."""
    resumable = [p for _, p in checkpoints(root) if (p / TRAIN_STATE / STATE_FILE).is_file()]
    return resumable[-1] if resumable else None


def write_state(directory: Path, state: dict) -> None:
    (directory / TRAIN_STATE).mkdir(parents=True, exist_ok=True)
    (directory / TRAIN_STATE / STATE_FILE).write_text(json.dumps(state, indent=2))


def read_state(checkpoint: Path) -> dict:
    return read_json(checkpoint / TRAIN_STATE / STATE_FILE,
                     f"delete {checkpoint} to resume from an earlier checkpoint, or pass trainer.resume=disable")


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

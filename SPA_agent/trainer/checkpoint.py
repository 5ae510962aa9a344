"""PPO checkpoints: `<default_local_dir>/global_step_<s>/{actor,critic,trainer_state.pt}` (spec §10.5).

A checkpoint is written into its staging directory and renamed into place (SPA_agent/runs/checkpoint_dirs.py), then
`latest_checkpointed_iteration.txt` is replaced atomically: an interrupted save never looks complete, and a
killed run loses at most the steps since its last checkpoint. `actor/` is a Hugging Face directory (model +
tokenizer, loadable with `from_pretrained`) plus `optimizer.pt`; `critic/` likewise (a token-classification
model with one label); `trainer_state.pt` holds the step, the env seed counters and the RNG states.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from SPA_agent.runs.atomic_io import write_text
from SPA_agent.runs.checkpoint_dirs import publish, saved_steps, staging_dir, step_dir

LATEST_FILE = "latest_checkpointed_iteration.txt"
TRAINER_STATE_FILE = "trainer_state.pt"
ROLES = ("actor", "critic")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: Path, step: int, write_models: Callable[[Path], None], trainer_state: dict,
                    keep: dict[str, int | None]) -> Path:
    """Write global_step_<step> atomically, point the latest file at it, prune old ones; its path.

    `write_models(dir)` writes `dir/actor` and `dir/critic`; `keep` maps role → checkpoints kept (None = all).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(root, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    write_models(staging)
    torch.save({**trainer_state, "step": step, "rng": rng_state()}, staging / TRAINER_STATE_FILE)
    target = publish(root, step)
    write_text(root / LATEST_FILE, f"{step}\n")
    prune(root, keep)
    return target


def prune(root: Path, keep: dict[str, int | None]) -> None:
    """Keep the newest `keep[role]` copies of each role; drop step dirs left with no role at all."""
    steps = saved_steps(root)
    for role in ROLES:
        limit = keep.get(role)
        if limit is None or limit < 1:
            continue
        for step in steps[:-limit]:
            shutil.rmtree(step_dir(root, step) / role, ignore_errors=True)
    for step in steps[:-1]:
        if not any((step_dir(root, step) / role).exists() for role in ROLES):
            shutil.rmtree(step_dir(root, step))


def latest_step(root: Path) -> int | None:
    """The step named in latest_checkpointed_iteration.txt, if that checkpoint exists."""
    latest = Path(root) / LATEST_FILE
    if not latest.exists():
        return None
    step = int(latest.read_text().strip())
    if not (step_dir(root, step) / TRAINER_STATE_FILE).exists():
        raise FileNotFoundError(
            f"{latest} names step {step} but {step_dir(root, step)} is incomplete; delete the file to start fresh "
            "or pass trainer.resume_mode=disable"
        )
    return step


def load_trainer_state(root: Path, step: int) -> dict:
    return torch.load(step_dir(root, step) / TRAINER_STATE_FILE, weights_only=False)

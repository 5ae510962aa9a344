"""The checkpoints of both trainers: where they live, how one is saved, which are kept, where a run resumes.

    <root>/global_step_N/                       a complete checkpoint
    <root>/.global_step_N.tmp/                  the same checkpoint while it is being written
    <root>/latest_checkpointed_iteration.txt    N of the newest PPO checkpoint (verl's pointer; SFT keeps none)

What a checkpoint holds (spec §10.5 for PPO):

    PPO   actor/, critic/     Hugging Face directories (model + tokenizer, `from_pretrained`) plus optimizer.pt;
                              the critic is a token-classification model with one label; a LoRA role's adds
                              adapter/, and with trainer.save_merged_lora=False holds only adapter/ and optimizer.pt
          trainer_state.pt    the step, the env seed counters, the KL coefficient and the RNG states
    SFT   (the directory)     a Hugging Face directory: config, weights, tokenizer
          train_state/        trainer_state.json (global step, epoch, step in epoch, end-of-epoch flag),
                              optimizer.pt (full, unsharded), scheduler.pt, adapter.pt (the trainable LoRA weights,
                              only with LoRA: the HF weights are merged), rng_rank<r>.pt (each rank's torch RNG)

Saving: `stage` empties the staging directory, the trainer writes into it, `commit` renames it into place, points
the latest file at it (PPO) and prunes, so a killed run never leaves a `global_step_N/` that looks complete and loses
at most the steps since its last checkpoint; `clean_staging` removes what a killed run left behind. A run resumes
from the newest checkpoint that holds its trainer state (`latest_step`). The directory logic needs no torch (it is
imported where a state is saved or loaded), so tools that only read the layout start fast (SPA_agent.runs.relay).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from SPA_agent.runs.atomic_io import read_json, write_text

STEP_DIR = re.compile(r"^global_step_(\d+)$")
#: glob patterns of complete and staged checkpoints (a trainer's owned outputs)
STEP_GLOB = "global_step_*"
STAGING_GLOB = ".global_step_*.tmp"
#: the newest PPO step, rewritten atomically after each PPO checkpoint
LATEST_FILE = "latest_checkpointed_iteration.txt"
#: PPO: the model directories pruned on their own schedules, and the trainer state
ROLES = ("actor", "critic")
TRAINER_STATE_FILE = "trainer_state.pt"
#: SFT: the training state beside the Hugging Face files
TRAIN_STATE = "train_state"
STATE_FILE = "trainer_state.json"
#: a checkpoint holding one of these (PPO's, SFT's) can be resumed from
RESUME_STATES = (TRAINER_STATE_FILE, f"{TRAIN_STATE}/{STATE_FILE}")


# ---------------------------------------------------------------- directories

def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def staging_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".global_step_{step}.tmp"


def saved(root: str | Path) -> list[tuple[int, Path]]:
    """All complete `global_step_N` directories under root as (N, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def saved_steps(root: str | Path) -> list[int]:
    """Steps of the complete checkpoint directories under `root`, ascending."""
    return [step for step, _ in saved(root)]


def clean_staging(root: str | Path) -> None:
    """Remove staging directories a killed run left behind."""
    for path in Path(root).glob(STAGING_GLOB) if Path(root).is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- save, prune, resume

def stage(root: str | Path, step: int) -> Path:
    """The empty staging directory of `step`, for the trainer to write its checkpoint into."""
    staging = staging_dir(root, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit(root: str | Path, step: int, keep: dict[str, int | None], keep_rest: Callable[[Path], bool] | None = None,
           latest_file: bool = False) -> Path:
    """Rename the finished staging directory to `global_step_<step>` (replacing an older one of that name), write
    the latest file when `latest_file`, then `prune(root, keep, keep_rest)`; the checkpoint's path."""
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    staging_dir(root, step).rename(final)
    if latest_file:
        write_text(Path(root) / LATEST_FILE, f"{step}\n")
    prune(root, keep, keep_rest)
    return final


def prune(root: str | Path, keep: dict[str, int | None], keep_rest: Callable[[Path], bool] | None = None) -> None:
    """Keep part `p` (a file or folder of each checkpoint) in the newest `keep[p]` checkpoints only (None or < 1:
    in all). An older checkpoint left with none of the parts is removed, unless `keep_rest(path)`, asked before its
    parts go, says its remaining files stay. The newest checkpoint is never touched."""
    found = saved(root)
    for index, (_, path) in enumerate(found[:-1]):
        expired = [part for part, limit in keep.items() if limit is not None and limit >= 1
                   and index < len(found) - limit]
        rest_stays = keep_rest is not None and keep_rest(path)
        for part in expired:
            shutil.rmtree(path / part, ignore_errors=True)
        if not rest_stays and not any((path / part).exists() for part in keep):
            shutil.rmtree(path)


def latest_step(root: str | Path) -> int | None:
    """The step to resume from: the newest checkpoint holding its trainer state (None if there is none). A latest
    file naming a checkpoint that does not hold one is an error."""
    resumable = [step for step, path in saved(root) if any((path / state).is_file() for state in RESUME_STATES)]
    latest = Path(root) / LATEST_FILE
    if latest.exists() and (named := int(latest.read_text().strip())) not in resumable:
        raise FileNotFoundError(
            f"{latest} names step {named} but {step_dir(root, named)} is incomplete; delete the file to resume from "
            "the newest complete checkpoint, or pass trainer.resume_mode=disable to start fresh"
        )
    return resumable[-1] if resumable else None


# ---------------------------------------------------------------- what a PPO checkpoint holds

def rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | Path, step: int, write_models: Callable[[Path], None], trainer_state: dict,
                    keep: dict[str, int | None]) -> Path:
    """Save PPO's global_step_<step>: `write_models(dir)` writes `dir/actor` and `dir/critic`, `trainer_state`
    (plus the step and the RNG states) goes to trainer_state.pt; `keep` maps role → checkpoints kept (None = all)."""
    import torch

    staging = stage(root, step)
    write_models(staging)
    torch.save({**trainer_state, "step": step, "rng": rng_state()}, staging / TRAINER_STATE_FILE)
    return commit(root, step, keep, latest_file=True)


def load_trainer_state(root: str | Path, step: int) -> dict:
    import torch

    return torch.load(step_dir(root, step) / TRAINER_STATE_FILE, weights_only=False)


# ---------------------------------------------------------------- what an SFT checkpoint holds

def write_train_state(directory: Path, state: dict) -> None:
    (directory / TRAIN_STATE).mkdir(parents=True, exist_ok=True)
    (directory / TRAIN_STATE / STATE_FILE).write_text(json.dumps(state, indent=2))


def read_train_state(checkpoint: Path) -> dict:
    return read_json(checkpoint / TRAIN_STATE / STATE_FILE,
                     f"delete {checkpoint} to resume from an earlier checkpoint, or pass trainer.resume=disable")


def closed_an_epoch(checkpoint: Path) -> bool:
    """Whether an SFT checkpoint's Hugging Face weights outlive its training state: it ended an epoch (or its
    training state is already gone, which only an epoch end's is)."""
    state = checkpoint / TRAIN_STATE / STATE_FILE
    return not state.exists() or json.loads(state.read_text()).get("end_of_epoch", False)

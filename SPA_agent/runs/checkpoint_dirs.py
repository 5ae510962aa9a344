"""The checkpoint directories of a trainer's output directory (SFT and PPO alike).

    <root>/global_step_N/          a complete checkpoint (what it holds is the trainer's business)
    <root>/.global_step_N.tmp/     the same checkpoint while it is being written

A checkpoint is written into its staging directory and renamed into place when complete (`publish`), so a killed
run never leaves a `global_step_N/` that looks complete; `clean_staging` removes what a killed run left behind.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

STEP_DIR = re.compile(r"^global_step_(\d+)$")
#: glob patterns of complete and staged checkpoints (a trainer's owned outputs)
STEP_GLOB = "global_step_*"
STAGING_GLOB = ".global_step_*.tmp"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def staging_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".global_step_{step}.tmp"


def checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """All complete `global_step_N` directories under root as (N, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def saved_steps(root: str | Path) -> list[int]:
    """Steps of the complete checkpoint directories under `root`, ascending."""
    return [step for step, _ in checkpoints(root)]


def publish(root: str | Path, step: int) -> Path:
    """Rename the finished staging directory to `global_step_<step>` (replacing an older one of that name)."""
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    staging_dir(root, step).rename(final)
    return final


def clean_staging(root: str | Path) -> None:
    """Remove staging directories a killed run left behind."""
    for path in Path(root).glob(STAGING_GLOB) if Path(root).is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)

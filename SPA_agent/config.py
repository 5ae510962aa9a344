"""Loading the Hydra configs under `config/` outside a `@hydra.main` entry point (tests, notebooks, scripts)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"
ENTRY_CONFIGS = ("_2_sokoban", "_3_frozen_lake", "_10_sudoku")


def compose(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose `config/<config_name>.yaml` with command-line style overrides, e.g. ["model=tiny"]."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    if not (CONFIG_DIR / f"{config_name}.yaml").exists():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ValueError(f"unknown config name {config_name!r}; choose one of {known}")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides))

"""World-model SFT in the calling process (one rank, no torchrun): for tests and sweeps that chain stages.

    from sft.in_process import train_on
    checkpoint = train_on("data", "out", "tiny", ["trainer.device=cpu"])   # stage 1's output in data/

`train_on` takes stage 2's overrides from the stage definition (SPA_agent/stages.py), as the scripts and the
three-arm study do; `train` takes Hydra overrides as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from sft.spa_sft_trainer import SftTrainer
from SPA_agent.runs import checkpoints
from SPA_agent.stages import sft_overrides

CONFIG_DIR = Path(__file__).resolve().parent / "config"


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """sft/config/sft_trainer.yaml with command-line style overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="sft_trainer", overrides=list(overrides))


def run(cfg: DictConfig, stop_at_step: int | None = None) -> None:
    """setup / train (up to `stop_at_step`, None: to the end) / cleanup of one rank."""
    trainer = SftTrainer(cfg)
    try:
        trainer.setup()
        trainer.train(stop_at_step)
    finally:
        trainer.cleanup()


def train(overrides: Sequence[str] = ()) -> Path:
    """One rank trained to the end; returns the last `global_step_N` checkpoint directory."""
    cfg = compose(overrides)
    run(cfg)
    return checkpoints.saved(cfg.trainer.default_local_dir)[-1][1]


def train_on(data_dir: str | Path, save_dir: str | Path, model: str, overrides: Sequence[str] = ()) -> Path:
    """`model` trained on stage 1's splits in `data_dir` into `save_dir`, one rank, to the end (`overrides` last);
    returns the last `global_step_N` checkpoint directory."""
    return train(sft_overrides(data_dir, save_dir, model, overrides=overrides))

"""Where step metrics go: the console, `<default_local_dir>/metrics.jsonl` (always), and wandb when configured."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from SPA_agent.atomic_io import write_jsonl
from SPA_agent.metrics_file import read_records

METRICS_FILE = "metrics.jsonl"
LOGGERS = ("console", "wandb")
#: keys shown in the one-line console summary of a step, when present
CONSOLE_KEYS = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "timing_s/step")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file (one dict per logged step; a cut-short last line is dropped)."""
    return read_records(path)[0]


class MetricLogger:
    """Appends one JSON line per step (`step` plus every metric); prints a summary; mirrors to wandb."""

    def __init__(self, cfg: DictConfig, output_dir: Path):
        unknown = set(cfg.trainer.logger) - set(LOGGERS)
        if unknown:
            raise ValueError(f"unknown trainer.logger entries {sorted(unknown)}; choose from {list(LOGGERS)}")
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.console = "console" in cfg.trainer.logger
        self.wandb = None
        if "wandb" in cfg.trainer.logger:
            self.wandb = _init_wandb(cfg)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run re-logs them) and a cut-short last line, rewriting
        the file atomically."""
        records, intact = read_records(self.path)
        if not intact or any(r["step"] > step for r in records):
            write_jsonl(self.path, [r for r in records if r["step"] <= step])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.console:
            shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
            tqdm.write(f"step {step}: {shown}" if shown else f"step {step}: {len(metrics)} metrics")
        if self.wandb is not None:
            self.wandb.log(dict(metrics), step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def _jsonable(value: float) -> float | str:
    """JSON has no NaN/inf: write them as strings so a broken step stays visible in the log."""
    value = float(value)
    return value if math.isfinite(value) else str(value)


def _init_wandb(cfg: DictConfig):
    try:
        import wandb
    except ImportError as err:
        raise ValueError("trainer.logger includes wandb but it is not installed: pip install 'spa-agent[wandb]'") from err
    wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.experiment_name,
               config=OmegaConf.to_container(cfg, resolve=True))
    return wandb

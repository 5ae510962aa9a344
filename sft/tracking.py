"""Metric sinks of the SFT trainer: JSON lines next to the outputs (always) and wandb (when configured)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from SPA_agent import atomic_io
from SPA_agent.metrics_file import read_records

METRICS_FILE = "metrics.jsonl"


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records past `last_step` (a resumed run re-logs them) and a cut-short last line; atomic rewrite."""
    if not path.is_file():
        return
    records, _ = read_records(path)
    atomic_io.write_jsonl(path, [r for r in records if r["step"] <= last_step])


class MetricsLogger:
    """Appends `{"step": s, <name>: value, ...}` lines to `<out_dir>/metrics.jsonl`; mirrors to wandb.

    Args:
        loggers: `trainer.logger`, e.g. ["console", "wandb"]; console output is the trainer's progress bar.
        wandb_mode: "online" or "offline" (the entry point picks offline when no API key is set).
    """

    def __init__(self, out_dir: str | Path, loggers: Sequence[str], project: str, experiment: str,
                 config: dict[str, Any], wandb_mode: str = "offline", resume_step: int = 0):
        self.path = Path(out_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, resume_step)
        unknown = set(loggers) - {"console", "wandb"}
        if unknown:
            raise ValueError(f"trainer.logger has unknown entries {sorted(unknown)}; use console and/or wandb")
        self.wandb = None
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError:
                raise ValueError("trainer.logger contains wandb but wandb is not installed: "
                                 "pip install 'spa-agent[wandb]'") from None
            self.wandb = wandb.init(project=project, name=experiment, config=config, mode=wandb_mode,
                                    dir=str(self.path.parent))

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()

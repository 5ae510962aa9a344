"""Where a trainer's step metrics go: `<output_dir>/metrics.jsonl` (always), a one-line console summary per step
(when asked for) and wandb (when configured). The SFT and PPO trainers both log through `MetricsLogger`."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from SPA_agent.runs.metrics_file import read_records, truncate_after

METRICS_FILE = "metrics.jsonl"
LOGGERS = ("console", "wandb")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file (one dict per logged step; a cut-short last line is dropped)."""
    return read_records(path)[0]


class MetricsLogger:
    """Appends one JSON line per step (`step` plus every metric, sorted by name); mirrors to wandb.

    Args:
        output_dir: the run's directory; the log is `<output_dir>/metrics.jsonl`.
        loggers: `trainer.logger`, e.g. ["console", "wandb"].
        project, experiment, config: the wandb run's project, name and recorded config.
        console_keys: with "console", print these metrics of each step on one line (none: print nothing, the
            caller shows its own progress).
        wandb_init: further `wandb.init` arguments (e.g. mode, dir).
    """

    def __init__(self, output_dir: str | Path, loggers: Sequence[str], project: str, experiment: str,
                 config: dict[str, Any], console_keys: Sequence[str] = (), **wandb_init: Any):
        unknown = set(loggers) - set(LOGGERS)
        if unknown:
            raise ValueError(f"unknown trainer.logger entries {sorted(unknown)}; choose from {list(LOGGERS)}")
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.console_keys = tuple(console_keys) if "console" in loggers else ()
        self.wandb = None
        if "wandb" in loggers:
            self.wandb = _init_wandb(project=project, name=experiment, config=config, **wandb_init)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run re-logs them) and a cut-short last line, rewriting
        the file atomically."""
        truncate_after(self.path, step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.console_keys:
            shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in self.console_keys if k in metrics)
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


def _init_wandb(**init: Any):
    try:
        import wandb
    except ImportError as err:
        raise ValueError("trainer.logger includes wandb but it is not installed: pip install 'spa-agent[wandb]'") from err
    return wandb.init(**init)

"""PNG plots (matplotlib, Agg backend): pass@k over k from an evaluation; validation success / pass@G over
training steps and the RL-health diagnostics (docs/diagnostics.md) from a PPO run's metrics.jsonl; and several
runs side by side with intervals (`plot_arms`). The command line is `python -m SPA_agent.plots`
(SPA_agent/plots.py).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from SPA_agent.evaluation.learning_curves import Curve
from SPA_agent.runs import atomic_io
from SPA_agent.runs.metrics_file import read_records

VAL_KEY = re.compile(r"^val-env/(?P<tag>[^/]+)/(?P<name>success|pass@\d+)$")
#: panels of the diagnostics figure: (title, y label, metric keys plotted when logged)
DIAGNOSTIC_PANELS = (
    ("entropy by span", "nats", tuple(f"diag/entropy/{s}" for s in ("all", "state", "reasoning", "answer", "other"))),
    ("share of trained tokens", "fraction",
     tuple(f"diag/token_share/{s}" for s in ("state", "reasoning", "answer", "other"))),
    ("distinct responses", "ratio", ("train/diag/distinct_in_group", "train/diag/distinct_batch",
                                     "val-env/diag/distinct_in_group", "val-env/diag/distinct_batch")),
    ("input dependence of reasoning", "accuracy / nats", ("diag/mi/accuracy", "diag/mi/chance", "diag/mi/estimate")),
    ("score std within groups", "std", ("rollout/in_group_std", "rollout/chosen_in_group_std")),
    ("format valid", "fraction of turns", ("train/diag/format_valid", "val-env/diag/format_valid")),
    ("KL to reference", "nats", ("diag/kl_ref", *(f"diag/kl_ref/{s}" for s in ("state", "reasoning", "answer")),
                                 "actor/kl_loss", "actor/reward_kl_penalty")),
    ("response length", "tokens", ("response_length/mean", "train/response_length", "val-env/response_length")),
)


def _save(fig, path: Path) -> Path:
    atomic_io.write_atomic(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    plt.close(fig)
    return Path(path)


def _ks(metrics: Mapping) -> list[int]:
    """The k values of the `pass@<k>` keys."""
    return [int(m.group(1)) for key in metrics if (m := re.fullmatch(r"pass@(\d+)", key))]


def plot_passk(result: Mapping, path: Path) -> Path:
    """Unbiased pass@k against k with its 95% bootstrap band, one line per env tag (`result` = eval.json)."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for tag, metrics in result["metrics"].items():
        ks = sorted(_ks(metrics))
        if not ks:
            continue
        ax.plot(ks, [metrics[f"pass@{k}"] for k in ks], marker="o", label=tag)
        ax.fill_between(ks, [metrics[f"pass@{k}_ci_low"] for k in ks], [metrics[f"pass@{k}_ci_high"] for k in ks],
                        alpha=0.2)
    ax.set(xlabel="k", ylabel="pass@k (unbiased)", ylim=(0, 1), xscale="log", title=result.get("model_name", ""))
    ax.set_xticks(sorted({k for m in result["metrics"].values() for k in _ks(m)}) or [1])
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.legend()
    return _save(fig, path)


def read_metrics_jsonl(path: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{tag: {metric: [(step, value), …]}} of the `val-env/<Tag>/success|pass@G` keys in a metrics.jsonl."""
    curves: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} does not exist")
    for record in read_records(path)[0]:
        for key, value in record.items():
            match = VAL_KEY.match(key)
            if match and "step" in record and value is not None:
                curves[match["tag"]][match["name"]].append((int(record["step"]), float(value)))
    return curves


def plot_training(run_dir: Path, out_path: Path | None = None) -> Path:
    """Validation success and pass@G over training steps, one panel per env tag."""
    metrics_file = Path(run_dir) / "metrics.jsonl"
    if not metrics_file.is_file():
        raise FileNotFoundError(f"{metrics_file} not found: pass a PPO run directory (it holds metrics.jsonl)")
    curves = read_metrics_jsonl(metrics_file)
    if not curves:
        raise ValueError(f"{metrics_file} has no val-env/<Tag>/success or pass@<G> values with a step")
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.5), squeeze=False)
    for ax, (tag, series) in zip(axes[0], sorted(curves.items())):
        for name, points in sorted(series.items()):
            steps, values = zip(*sorted(points))
            ax.plot(steps, values, marker=".", label=name)
        ax.set(title=tag, xlabel="training step", ylabel="validation", ylim=(0, 1))
        ax.legend()
    return _save(fig, out_path or Path(run_dir) / "val_curves.png")


def read_series(path: Path, keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), …]} of the given keys of a metrics.jsonl, finite values only (a NaN is logged as a
    string)."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for record in read_records(path)[0]:
        for key in keys:
            if isinstance(record.get(key), (int, float)) and "step" in record:
                series[key].append((int(record["step"]), float(record[key])))
    return series


def plot_diagnostics(run_dir: Path, out_path: Path | None = None) -> Path:
    """The RL-health diagnostics over training steps (DIAGNOSTIC_PANELS; a panel says so when nothing is logged)."""
    metrics_file = Path(run_dir) / "metrics.jsonl"
    series = read_series(metrics_file, tuple(key for _, _, keys in DIAGNOSTIC_PANELS for key in keys))
    if not any(key.startswith(("diag/", "train/diag/", "val-env/diag/")) for key in series):
        raise ValueError(f"{metrics_file} has no diagnostics (diag/* keys)")
    fig, axes = plt.subplots(2, 4, figsize=(20, 7), squeeze=False)
    for ax, (title, ylabel, keys) in zip(axes.flat, DIAGNOSTIC_PANELS):
        ax.set(title=title, xlabel="training step", ylabel=ylabel)
        logged = [key for key in keys if series.get(key)]
        for key in logged:
            steps, values = zip(*sorted(series[key]))
            ax.plot(steps, values, marker=".", label=key, linestyle="--" if key.startswith("val-env/") else "-")
        if logged:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return _save(fig, out_path or Path(run_dir) / "diagnostics.png")


def plot_arms(curves: Mapping[str, Curve], path: Path) -> Path:
    """Runs side by side (learning_curves.Curve by name): validation success with its 95% interval band, and the
    actor entropy, against the PPO step."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 7), sharex=True)
    for name, curve in curves.items():
        if curve.points:
            steps = [p.step for p in curve.points]
            line, = top.plot(steps, [p.success for p in curve.points], marker=".", label=name)
            top.fill_between(steps, [p.low for p in curve.points], [p.high for p in curve.points],
                             color=line.get_color(), alpha=0.2)
        if curve.entropy:
            bottom.plot(*zip(*curve.entropy), label=name)
    episodes = sorted({c.episodes for c in curves.values()})
    top.set(ylabel=f"validation success ({'/'.join(map(str, episodes))} episodes, 95% CI)", ylim=(0, 1))
    bottom.set(xlabel="PPO step", ylabel="actor entropy")
    top.legend()
    bottom.legend()
    return _save(fig, path)


def plot_dir(path: Path, out_dir: Path | None = None) -> list[Path]:
    """Every plot that `path` supports: eval.json → passk.png; metrics.jsonl → val_curves.png and, when it holds
    diagnostics, diagnostics.png."""
    path, written = Path(path), []
    out_dir = Path(out_dir) if out_dir else path
    if (path / "eval.json").is_file():
        written.append(plot_passk(json.loads((path / "eval.json").read_text()), out_dir / "passk.png"))
    if (path / "metrics.jsonl").is_file():
        metrics_file = path / "metrics.jsonl"
        has_diagnostics = bool(read_series(metrics_file, ("diag/entropy/all", "train/diag/format_valid")))
        if read_metrics_jsonl(metrics_file) or not has_diagnostics:  # plot_training names what is missing
            written.append(plot_training(path, out_dir / "val_curves.png"))
        if has_diagnostics:
            written.append(plot_diagnostics(path, out_dir / "diagnostics.png"))
    if not written:
        raise FileNotFoundError(f"{path} holds neither eval.json nor metrics.jsonl")
    return written

"""What a three-arm experiment shows: DIR/report/{report.md, report.json, arms.png} and one status line per stage and
arm (for polling a background run)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from SPA_agent.evaluation.learning_curves import SUCCESS_KEY, CurvePoint, intervals_overlap, load_curve
from SPA_agent.evaluation.plots import plot_arms
from SPA_agent.runs import atomic_io
from SPA_agent.runs.metrics_file import read_records
from SPA_agent.runs.run_identity import git_commit
from SPA_agent.selfplay.data_card import CARD_FILE
from SPA_agent.spa_arms.experiment import Experiment, read_eval
from SPA_agent.spa_arms.settings import ARMS, StageError


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _point(p: CurvePoint | None) -> str:
    return "–" if p is None else f"{p.success:.3f} [{p.low:.3f}, {p.high:.3f}]"


def worldmodel_exact(result: Mapping | None) -> dict[str, float | int | None]:
    """Format rate (turns with state blocks) and, over those turns, observation and prediction exact match of an
    add_worldmodel evaluation (its single env tag), and the training step of the checkpoint evaluated; None where
    absent."""
    metrics = next(iter(result["metrics"].values())) if result else {}
    step = re.search(r"global_step_(\d+)", result["model_path"]) if result else None
    return {**{name: metrics.get(f"worldmodel/{key}") for name, key in (
        ("format", "format_rate"), ("observation", "observation_exact"), ("prediction", "prediction_exact"))},
            "step": int(step.group(1)) if step else None}


def _worldmodel_cell(wm: Mapping[str, float | int | None], with_step: bool = False) -> str:
    if wm["format"] is None:
        return "–"
    at = f", step {wm['step']}" if with_step and wm["step"] is not None else ""
    return f"obs {_fmt(wm['observation'])} / pred {_fmt(wm['prediction'])} (format {_fmt(wm['format'])}{at})"


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _commit() -> str:
    """The checkout's commit; SPA_AGENT_COMMIT names it where the code was copied without its git history."""
    commit = git_commit()
    return commit[:7] if commit else os.environ.get("SPA_AGENT_COMMIT", "unknown")


def write_report(exp: Experiment) -> Path:
    """DIR/report/{report.md, report.json, arms.png} from whatever the runs have logged so far."""
    curves = {arm: load_curve(exp.ppo_dir(arm)) for arm in exp.s.arms
              if (exp.ppo_dir(arm) / "metrics.jsonl").is_file() and (exp.ppo_dir(arm) / "config.yaml").is_file()}
    if not curves:
        raise StageError(f"no PPO run under {exp.out / 'ppo'} has logged anything yet: run the ppo stage first")
    out = exp.out / "report"
    summary, data = [], {}
    for arm in exp.s.arms:
        curve = curves.get(arm)
        points = {p.step: p for p in curve.points} if curve else {}
        init, final = points.get(0), points[max(points)] if points else None
        wm = {which: worldmodel_exact(read_eval(exp.eval_dir(arm, which))) for which in ("sft", "ppo")}
        entropy = curve.entropy if curve else []
        change = None if init is None or final is None or final.step == 0 else 100 * (final.success - init.success)
        overlap = "–" if change is None else ("yes" if intervals_overlap(init, final) else "no")
        summary.append(f"| {ARMS[arm][2]} | {_point(init)} | {_point(final)} (step {final.step if final else '–'}) | "
                       f"{_fmt(change, 1)} | {overlap} | {_worldmodel_cell(wm['sft'])} | {_worldmodel_cell(wm['ppo'], with_step=True)} | "
                       f"{_fmt(entropy[0][1] if entropy else None)} → {_fmt(entropy[-1][1] if entropy else None)} |")
        data[arm] = {"label": ARMS[arm][2], "episodes": curve.episodes if curve else None,
                     "validation": [asdict(p) for p in curve.points] if curve else [], "entropy": entropy,
                     "worldmodel": wm}
    steps = sorted({p.step for c in curves.values() for p in c.points})
    per_step = [f"| {step} | " + " | ".join(_point(next((p for p in curves[a].points if p.step == step), None))
                                           if a in curves else "–" for a in exp.s.arms) + " |" for step in steps]
    episodes = sorted({c.episodes for c in curves.values()})
    device, commit = _device(), _commit()
    lines = [
        f"# SPA arms on {exp.s.config}, model {exp.s.model}", "",
        f"Device: {device}; commit {commit}; validation: {'/'.join(map(str, episodes))} episodes per point "
        f"({exp.s.val_groups} puzzles × {exp.s.val_group_size}), 95% percentile bootstrap intervals over episodes; "
        f"world-model exact match on {exp.s.wm_puzzles} validation puzzles with add_worldmodel prompts.", "",
        "| arm | SFT init success (step 0) | final success | change (points) | intervals overlap | "
        "world model after SFT | world model after PPO | actor entropy (first → last step) |",
        "|---|---|---|---|---|---|---|---|", *summary, "",
        "World model: exact match of `<observation>` and `<prediction>` with the true states, over the turns that "
        "wrote them; format = fraction of turns that did; after PPO: the last saved actor, at the step named.", "",
        "Validation success [95% interval] per PPO step:", "",
        "| step | " + " | ".join(exp.s.arms) + " |", "|---" * (len(exp.s.arms) + 1) + "|", *per_step, "",
        f"Settings: `{json.dumps(asdict(exp.s))}`", ""]
    out.mkdir(parents=True, exist_ok=True)
    plot_arms({arm: curves[arm] for arm in exp.s.arms if arm in curves}, out / "arms.png")
    atomic_io.write_json(out / "report.json", {"device": device, "commit": commit, "settings": asdict(exp.s),
                                               "arms": data})
    atomic_io.write_text(out / "report.md", "\n".join(lines))
    return out / "report.md"


def job_state(exp: Experiment, name: str) -> str:
    pid_file, rc_file = exp.logs / f"{name}.pid", exp.logs / f"{name}.rc"
    if pid_file.is_file():
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, 0)
            return f"running (pid {pid})"
        except OSError:
            return f"stopped (pid {pid} is gone, no exit status)"
    if rc_file.is_file():
        rc = int(rc_file.read_text())
        return "exited 0" if rc == 0 else f"failed (exit {rc}, {exp.logs / name}.log)"
    return "not started"


def _last_record(path: Path) -> dict:
    records, _ = read_records(path)
    return records[-1] if records else {}


def status_lines(exp: Experiment) -> list[str]:
    """One line per stage and arm: what is complete, running or missing."""
    lines = []
    card = exp.data_dir() / CARD_FILE
    if card.is_file():
        c = json.loads(card.read_text())
        lines.append(f"data            done: {c['num_rows']} rows, {c['num_trajectories']} trajectories, "
                     f"generating policy success {c['success_rate']:.3f}")
    else:
        lines.append(f"data            {job_state(exp, 'data')}")
    nowm = exp.data_dir("nowm") / CARD_FILE
    lines.append(f"data_nowm       {'done' if nowm.is_file() else 'not yet'}")
    for arm in exp.s.arms:
        checkpoint = exp.sft_checkpoint(arm)
        if checkpoint is not None:
            lines.append(f"sft/{arm:<11} done: {checkpoint.name}")
        else:
            last = _last_record(exp.sft_dir(arm) / "metrics.jsonl")
            loss = f", train loss {last['train/loss']:.3f}" if "train/loss" in last else ""
            lines.append(f"sft/{arm:<11} {job_state(exp, f'sft-{arm}')}; step {last.get('step', 0)}{loss}")
    for arm in exp.s.arms:
        records, _ = read_records(exp.ppo_dir(arm) / "metrics.jsonl")  # [] before the run has logged
        step = max((int(r["step"]) for r in records), default=0)
        val = [r for r in records if any(SUCCESS_KEY.match(k) for k in r)]
        last_val = ""
        if val:
            key = next(k for k in val[-1] if SUCCESS_KEY.match(k))
            last_val = f", val success {val[-1][key]:.3f} at step {val[-1]['step']} (step 0: {val[0][key]:.3f})"
        state = "done" if exp.ppo_done(arm) else job_state(exp, f"ppo-{arm}")
        lines.append(f"ppo/{arm:<11} {state}; step {step}/{exp.s.ppo_steps}{last_val}")
    for arm in exp.s.arms:
        for which in ("sft", "ppo"):
            result, label = read_eval(exp.eval_dir(arm, which)), f"wm/{arm}/{which}".ljust(15)
            state = f"done: {_worldmodel_cell(worldmodel_exact(result), with_step=which == 'ppo')}" if result else \
                job_state(exp, f"wm-{arm}-{which}")
            lines.append(f"{label} {state}")
    report = exp.out / "report" / "report.md"
    lines.append(f"report          {'written: ' + str(report) if report.is_file() else 'not yet'}")
    return lines

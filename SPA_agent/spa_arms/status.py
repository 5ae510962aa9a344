"""Where a three-arm experiment stands: one status line per stage and arm (for polling a background run), and
its report (SPA_agent.evaluation.report.write_arms_report) from the experiment's directories and settings."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from SPA_agent.evaluation.learning_curves import SUCCESS_KEY
from SPA_agent.evaluation.report import Arm, arm_curves, worldmodel_cell, worldmodel_exact, write_arms_report
from SPA_agent.runs.metrics_file import read_records
from SPA_agent.selfplay.data_card import CARD_FILE
from SPA_agent.spa_arms.experiment import Experiment, read_eval
from SPA_agent.spa_arms.settings import ARMS, StageError


def write_report(exp: Experiment) -> Path:
    """DIR/report/{report.md, report.json, arms.png} from whatever the runs have logged so far."""
    arms = {arm: Arm(ARMS[arm][2], exp.ppo_dir(arm), {which: read_eval(exp.eval_dir(arm, which))
                                                      for which in ("sft", "ppo")})
            for arm in exp.s.arms}
    curves = arm_curves(arms)
    if not curves:
        raise StageError(f"no PPO run under {exp.out / 'ppo'} has logged anything yet: run the ppo stage first")
    setup = (f"({exp.s.val_groups} puzzles × {exp.s.val_group_size}), 95% percentile bootstrap intervals over "
             f"episodes; world-model exact match on {exp.s.wm_puzzles} validation puzzles with add_worldmodel prompts.")
    return write_arms_report(exp.out / "report", arms, curves, f"SPA arms on {exp.s.config}, model {exp.s.model}",
                             setup, asdict(exp.s))


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
            state = f"done: {worldmodel_cell(worldmodel_exact(result), with_step=which == 'ppo')}" if result else \
                job_state(exp, f"wm-{arm}-{which}")
            lines.append(f"{label} {state}")
    report = exp.out / "report" / "report.md"
    lines.append(f"report          {'written: ' + str(report) if report.is_file() else 'not yet'}")
    return lines

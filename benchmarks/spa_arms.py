"""Issue 13's SPA experiment at small scale: three arms from the same self-play data, SFT, then PPO side by side.

    python benchmarks/spa_arms.py all --out arms          # every stage below, in order
    python benchmarks/spa_arms.py status --out arms       # one line per stage and arm (for polling a background run)
    python benchmarks/spa_arms.py all --out arms_grpo --from arms --ppo-overrides "algorithm.adv_estimator=grpo"
                                                          # PPO again from the SFT checkpoints of arms

Arms: `spa` (a: world-model SFT, loss_target=paper), `nowm` (b: the same trajectories without <observation>/
<prediction>, base prompts, loss_target=paper), `released` (c: loss_target=released). Stages, each skipping what is
complete and continuing what was interrupted (SFT and PPO from their last checkpoint, data per batch):

  data    self-play data with the random generator in add_worldmodel mode (DIR/data), and the same rows without
          world model (DIR/data_nowm, SPA_agent.selfplay.data_variants.without_worldmodel_row; its data card comes last)
  sft     one SFT run per arm, in parallel processes -> DIR/sft/<arm>, then DIR/sft/<arm>.json (the checkpoint)
  wm      world-model accuracy (SPA_agent.evaluate, add_worldmodel prompts) of each SFT checkpoint and of each
          PPO run's last saved actor, finished or not -> DIR/eval/<arm>/{sft,ppo}/eval.json
  ppo     PPO from each arm's SFT checkpoint, the arms as parallel processes on one device -> DIR/ppo/<arm>;
          validation at step 0 (the SFT init) and every --test-freq steps, checkpoints every --save-freq steps
  report  DIR/report/{report.md, report.json, arms.png}: validation success with 95% bootstrap intervals over
          episodes per step and arm, world-model accuracy after SFT and after PPO, actor entropy
  all     data, sft, then ppo with the SFT checkpoints' wm evaluations beside it, then wm, report

Every process logs to DIR/logs/<job>.log (with <job>.pid while it runs and <job>.rc when it ended). The settings
are recorded in DIR/settings.json by the first run; a later run with other settings is refused, except
--ppo-steps, which may grow (the PPO runs continue), --arms, --max-parallel and --devices (comma-separated GPU
ids that a stage's processes are spread over, round-robin; default: all on the default device). Extra overrides:
--overrides (data, PPO and evaluation: the env and rollout settings), --data-overrides, --sft-overrides,
--ppo-overrides, --eval-overrides (each one quoted string, split like a shell line).

--from DIR starts a new experiment from the data and SFT checkpoints of the experiment DIR: its data, data_nowm and
sft are linked into --out (relative symbolic links: the two directories may be moved or copied side by side), so
the data and sft stages find them complete and only PPO, the evaluations and the report run. The new experiment
starts from DIR's settings; options given replace them, except those its data and SFT were made with (--config,
--model, --data-batches, --sft-*, --overrides, --data-overrides), which a different value refuses. DIR's data and
SFT must be complete for every arm run, and --out must not have data or SFT of its own. Like the other settings,
--from is recorded in settings.json (as from_dir, relative to --out) and cannot change later.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from SPA_agent.evaluation.learning_curves import SUCCESS_KEY, CurvePoint, intervals_overlap, load_curve
from SPA_agent.plots import plot_arms
from SPA_agent.runs import atomic_io
from SPA_agent.runs.metrics_file import read_records
from SPA_agent.runs.run_identity import git_commit
from SPA_agent.selfplay.data_card import CARD_FILE
from SPA_agent.selfplay.data_variants import without_worldmodel_row

ARMS = {
    "spa": ("data", "paper", "(a) SPA: world-model SFT, loss_target=paper"),
    "nowm": ("data_nowm", "paper", "(b) no world model: same trajectories, base format"),
    "released": ("data", "released", "(c) loss_target=released"),
}
SPLITS = ("wm_train", "wm_val")
#: settings that may change between runs into the same directory (the PPO runs continue to more steps; arms may
#: be added, they share the data)
MUTABLE = ("ppo_steps", "arms", "max_parallel", "devices")
#: settings that DIR's data and SFT were made with: an experiment --from DIR takes them from there, never others
FROM_SETTINGS = ("config", "model", "data_batches", "sft_epochs", "sft_lr", "sft_save_freq", "overrides",
                 "data_overrides", "sft_overrides")
#: what --from DIR links into --out
LINKED = ("data", "data_nowm", "sft")
#: command-line flags that are not the field name with dashes (`from` is a Python keyword)
FLAGS = {"from_dir": "--from"}
#: the checkout this script belongs to: its processes import the same code (PYTHONPATH)
REPO = Path(__file__).resolve().parents[1]


class StageError(Exception):
    """A stage that cannot run or whose processes failed: printed as one line."""


HELP = {
    "config": "entry config", "model": "model preset: small, or tiny for CPU checks",
    "data_batches": "self-play batches (es_manager.train: 32 × 8 trajectories each)",
    "sft_epochs": "SFT epochs", "sft_lr": "SFT learning rate", "sft_save_freq": "SFT checkpoint interval (steps)",
    "ppo_steps": "PPO steps per arm", "test_freq": "PPO validation interval (steps)",
    "save_freq": "PPO checkpoint interval (steps)", "val_groups": "validation puzzles of PPO",
    "val_group_size": "samples per validation puzzle", "wm_puzzles": "puzzles of the world-model evaluations",
    "arms": "arms to run", "overrides": "Hydra overrides of data, PPO and evaluation (one quoted string)",
    "data_overrides": "Hydra overrides of the data stage", "sft_overrides": "Hydra overrides of SFT",
    "ppo_overrides": "Hydra overrides of PPO", "eval_overrides": "Hydra overrides of the evaluations",
    "max_parallel": "processes at a time within a stage", "devices": "comma-separated GPU ids to spread processes over",
    "from_dir": "experiment directory whose data and SFT checkpoints this one links and starts PPO from",
}


@dataclass
class Settings:
    config: str = "_2_sokoban"
    model: str = "small"
    data_batches: int = 12
    sft_epochs: int = 2
    sft_lr: float = 5e-4
    sft_save_freq: int = 200
    ppo_steps: int = 150
    test_freq: int = 10
    save_freq: int = 25
    val_groups: int = 128
    val_group_size: int = 2
    wm_puzzles: int = 128
    arms: tuple[str, ...] = tuple(ARMS)
    overrides: str = ""
    data_overrides: str = ""
    #: one padded micro-batch of the 16 rows and no flex-attention compile (the small model: 1,104 steps, 2 epochs,
    #: in about 2 minutes on an H200)
    sft_overrides: str = "data.packing=false data.micro_batch_size_per_gpu=16 model.attn_implementation=sdpa"
    ppo_overrides: str = ""
    eval_overrides: str = ""
    max_parallel: int = 3
    devices: str = ""
    from_dir: str = ""


@dataclass
class Job:
    """One process of a stage: its log name, command and a check that its outputs are complete."""

    name: str
    argv: list[str]
    done: Callable[[], bool]
    after: Callable[[], None] = lambda: None


class Experiment:
    """Paths and commands of one experiment directory."""

    def __init__(self, out: Path, settings: Settings):
        self.out, self.s = out.resolve(), settings
        self.logs = self.out / "logs"

    # ------------------------------------------------------------------ paths
    def data_dir(self, arm: str | None = None) -> Path:
        return self.out / (ARMS[arm][0] if arm else "data")

    def sft_dir(self, arm: str) -> Path:
        return self.out / "sft" / arm

    def sft_marker(self, arm: str) -> Path:
        return self.out / "sft" / f"{arm}.json"

    def ppo_dir(self, arm: str) -> Path:
        return self.out / "ppo" / arm

    def eval_dir(self, arm: str, which: str) -> Path:
        return self.out / "eval" / arm / which

    def source_dir(self) -> Path | None:
        """DIR of --from, None without it."""
        return (self.out / self.s.from_dir).resolve() if self.s.from_dir else None

    def sft_checkpoint(self, arm: str) -> Path | None:
        marker = self.sft_marker(arm)
        return self.out / json.loads(marker.read_text())["checkpoint"] if marker.is_file() else None

    def ppo_step(self, arm: str) -> int | None:
        from SPA_agent.trainer.checkpoint import latest_step

        return latest_step(self.ppo_dir(arm))

    def ppo_done(self, arm: str) -> bool:
        return (self.ppo_step(arm) or 0) >= self.s.ppo_steps

    # ------------------------------------------------------------------ commands
    def _overrides(self, *extra: str) -> list[str]:
        return [o for text in (self.s.overrides, *extra) for o in shlex.split(text)]

    def data_job(self) -> Job:
        out = self.data_dir()
        return Job("data", [sys.executable, "-m", "SPA_agent.generate_sft_data", "--config-name", self.s.config,
                            f"model={self.s.model}", "generator=random", f"data_gen.num_batches={self.s.data_batches}",
                            f"data_gen.output_dir={out}", "data_gen.resume=true",
                            *self._overrides(self.s.data_overrides)],
                   lambda: (out / CARD_FILE).is_file())

    def sft_job(self, arm: str) -> Job:
        from SPA_agent.runs.checkpoint_dirs import checkpoints

        data, loss_target, _ = ARMS[arm]
        data_dir, out = self.out / data, self.sft_dir(arm)

        def record_checkpoint() -> None:
            checkpoint = checkpoints(out)[-1][1].relative_to(self.out)  # relative: the directory may move
            atomic_io.write_json(self.sft_marker(arm), {"checkpoint": str(checkpoint)})

        return Job(f"sft-{arm}", [
            sys.executable, "-m", "sft.spa_sft_trainer", f"data.train_files={data_dir / 'wm_train.parquet'}",
            f"data.val_files={data_dir / 'wm_val.parquet'}", f"model.partial_pretrain={self.s.model}",
            f"data.loss_target={loss_target}", f"optim.lr={self.s.sft_lr}", f"trainer.total_epochs={self.s.sft_epochs}",
            "data.max_length=4096", f"trainer.save_freq={self.s.sft_save_freq}", "trainer.max_ckpt_to_keep=2",
            f"trainer.default_local_dir={out}", f"trainer.experiment_name={arm}", "trainer.resume=auto",
            *shlex.split(self.s.sft_overrides)], self.sft_marker(arm).is_file, record_checkpoint)

    def ppo_job(self, arm: str) -> Job:
        checkpoint = self.sft_checkpoint(arm)
        if checkpoint is None:
            raise StageError(f"arm {arm} has no SFT checkpoint ({self.sft_marker(arm)}): run the sft stage first")
        g = self.s.val_groups
        return Job(f"ppo-{arm}", [
            sys.executable, "-m", "SPA_agent.trainer.main_ppo", "--config-name", self.s.config, f"model={self.s.model}",
            f"model_path={checkpoint}", "trainer.backend=local", f"trainer.default_local_dir={self.ppo_dir(arm)}",
            f"trainer.experiment_name={arm}", f"trainer.total_training_steps={self.s.ppo_steps}",
            f"trainer.test_freq={self.s.test_freq}", f"trainer.save_freq={self.s.save_freq}",
            "trainer.resume_mode=auto", "trainer.val_before_train=True", "trainer.validation_steps=1",
            "trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=2",
            f"es_manager.val.env_groups={g}", f"es_manager.val.group_size={self.s.val_group_size}",
            f"es_manager.val.env_configs.n_groups=[{g}]", *self._overrides(self.s.ppo_overrides)],
            lambda: self.ppo_done(arm))

    def wm_job(self, arm: str, which: str, model_path: Path) -> Job:
        """Evaluation of `model_path`; complete once eval.json holds that model (a PPO run continued to more
        steps is evaluated again; compared below the experiment directory, which may move)."""
        out, relative = self.eval_dir(arm, which), model_path.relative_to(self.out)
        return Job(f"wm-{arm}-{which}", [
            sys.executable, "-m", "SPA_agent.evaluate", "--config-name", self.s.config, f"model={self.s.model}",
            f"model_path={model_path}", "evaluation.prompt_mode=add_worldmodel",
            f"evaluation.num_puzzles={self.s.wm_puzzles}", "evaluation.n=1", "evaluation.k=[1]",
            "evaluation.write_plots=false", f"evaluation.output_dir={out}", *self._overrides(self.s.eval_overrides)],
            lambda: (result := read_eval(out)) is not None
            and Path(result["model_path"]).parts[-len(relative.parts):] == relative.parts)

    # ------------------------------------------------------------------ --from
    def link_source(self) -> None:
        """--from DIR: DIR's data, data_nowm and sft linked into this directory (relative links, so that the two
        directories may be moved or copied side by side); refused where DIR's data or SFT is incomplete for the
        arms, which the data and sft stages would otherwise continue inside DIR, or where this directory has a
        data or SFT of its own."""
        source = self.source_dir()
        if source is None:
            return
        needed = [source / "data" / CARD_FILE, source / "data_nowm" / CARD_FILE,
                  *(source / "sft" / f"{arm}.json" for arm in self.s.arms)]
        missing = [str(path.relative_to(source)) for path in needed if not path.is_file()]
        if missing:
            raise StageError(f"--from {source}: its data or SFT is not complete for arms {' '.join(self.s.arms)} "
                             f"(no {', '.join(missing)}): finish them there first")
        self.out.mkdir(parents=True, exist_ok=True)
        for name in LINKED:
            link, target = self.out / name, source / name
            if link.is_symlink() and link.resolve() == target.resolve():
                continue
            if link.is_symlink() or link.exists():
                raise StageError(f"{link} is not a link to {target}: --from needs an --out without data or SFT "
                                 "of its own")
            link.symlink_to(os.path.relpath(target, self.out))

    # ------------------------------------------------------------------ stages
    def stage_data(self) -> None:
        run_jobs(self, [self.data_job()])
        write_without_worldmodel(self.data_dir(), self.data_dir("nowm"), self.s)

    def stage_sft(self) -> None:
        missing = sorted({ARMS[arm][0] for arm in self.s.arms if not (self.out / ARMS[arm][0] / CARD_FILE).is_file()})
        if missing:
            raise StageError(f"no complete dataset in {missing} under {self.out}: run the data stage first")
        run_jobs(self, [self.sft_job(arm) for arm in self.s.arms])

    def ppo_jobs(self) -> list[Job]:
        return [self.ppo_job(arm) for arm in self.s.arms]

    def wm_jobs(self, unfinished: bool = False) -> list[Job]:
        """Evaluations of the SFT checkpoints there are and of the PPO runs' last saved actors: those of finished
        runs, and with `unfinished` also those of runs stopped earlier (the wm stage: a run that a lease ended
        still gets its world model measured, at the step the report names)."""
        jobs = []
        for arm in self.s.arms:
            if (checkpoint := self.sft_checkpoint(arm)) is not None:
                jobs.append(self.wm_job(arm, "sft", checkpoint))
            step = self.ppo_step(arm)
            if step is not None and (unfinished or self.ppo_done(arm)):
                jobs.append(self.wm_job(arm, "ppo", self.ppo_dir(arm) / f"global_step_{step}" / "actor"))
        return jobs

    def stage_ppo(self) -> None:
        run_jobs(self, self.ppo_jobs())

    def stage_wm(self) -> None:
        run_jobs(self, self.wm_jobs(unfinished=True))

    def stage_report(self) -> None:
        print(f"report written to {write_report(self)}", flush=True)

    def stage_ppo_beside_evaluations(self) -> None:
        """The PPO runs, and the evaluations of the SFT checkpoints in processes beside them."""
        jobs = [*self.ppo_jobs(), *self.wm_jobs()]
        run_jobs(self, jobs, limit=len(jobs))

    def stage_all(self) -> None:
        """data, sft; then PPO with the SFT checkpoints' evaluations beside it; the PPO actors' evaluations; the
        report. A failed evaluation or PPO arm does not stop the others; the stage fails at the end."""
        self.stage_data()
        self.stage_sft()
        errors = []
        for step in (self.stage_ppo_beside_evaluations, self.stage_wm, self.stage_report):
            try:
                step()
            except StageError as err:
                errors.append(str(err))
        if errors:
            raise StageError("; ".join(errors))


def read_eval(out: Path) -> dict | None:
    """eval.json of a finished evaluation, None when absent or incomplete."""
    path = out / "eval.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text(encoding="utf-8"))
    return result if result.get("complete") else None


def write_without_worldmodel(source: Path, target: Path, settings: Settings) -> None:
    """DIR/data_nowm: every row of DIR/data as the base prompt mode shows it; the data card is written last."""
    if (target / CARD_FILE).is_file():
        return
    from SPA_agent.config import compose

    envs = compose(settings.config, [f"model={settings.model}", *shlex.split(settings.overrides)]).custom_envs
    target.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        table = pq.read_table(source / f"{split}.parquet")
        rows = table.to_pylist()
        for row in rows:
            env = envs[row["env_tag"]]
            row["prompt"], row["response"] = without_worldmodel_row(
                row["prompt"], row["response"], env.env_instruction_add_worldmodel, env.env_instruction)
        atomic_io.write_parquet(target / f"{split}.parquet", pa.Table.from_pylist(rows, schema=table.schema))
        counts[split] = len(rows)
    atomic_io.write_json(target / CARD_FILE, {
        "stage": "world-model rows without world model (SPA_agent.selfplay.data_variants.without_worldmodel_row)",
        "source": source.name, "rows": counts,
        "source_card": json.loads((source / CARD_FILE).read_text(encoding="utf-8"))})
    print(f"data without world model written to {target} ({counts})", flush=True)


def run_jobs(exp: Experiment, jobs: list[Job], limit: int | None = None) -> None:
    """Run the jobs whose outputs are incomplete, at most `limit` (default --max-parallel) at a time; fail once
    they have all ended if any failed."""
    pending = [job for job in jobs if not job.done()]
    for job in jobs:
        if job not in pending:
            print(f"{job.name}: complete, skipped", flush=True)
    exp.logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONHASHSEED": "10000",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    devices, started = [d for d in exp.s.devices.split(",") if d.strip()], 0
    running: dict[str, tuple[Job, subprocess.Popen]] = {}
    failed = []
    while pending or running:
        while pending and len(running) < max(1, limit or exp.s.max_parallel):
            job = pending.pop(0)
            (exp.logs / f"{job.name}.rc").unlink(missing_ok=True)
            if devices:  # --devices: jobs round-robin over the listed GPUs
                env["CUDA_VISIBLE_DEVICES"] = devices[started % len(devices)]
            started += 1
            with open(exp.logs / f"{job.name}.log", "a", encoding="utf-8") as log:
                log.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(job.argv)}\n")
                log.flush()
                proc = subprocess.Popen(job.argv, stdout=log, stderr=subprocess.STDOUT, env=dict(env))
            atomic_io.write_text(exp.logs / f"{job.name}.pid", str(proc.pid))
            print(f"{job.name}: started (pid {proc.pid}, log {exp.logs / job.name}.log)", flush=True)
            running[job.name] = (job, proc)
        time.sleep(0.2)
        for name, (job, proc) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            atomic_io.write_text(exp.logs / f"{name}.rc", str(proc.returncode))
            (exp.logs / f"{name}.pid").unlink(missing_ok=True)
            if proc.returncode == 0:
                job.after()
                print(f"{name}: done", flush=True)
            else:
                failed.append(name)
                print(f"{name}: failed (exit {proc.returncode}), see {exp.logs / name}.log", flush=True)
    if failed:
        raise StageError(f"{', '.join(failed)} failed: see {exp.logs}/<job>.log")


# ---------------------------------------------------------------------- report
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


# ---------------------------------------------------------------------- status
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


# ---------------------------------------------------------------------- settings and entry point
def read_settings(directory: Path) -> dict:
    """settings.json of an experiment directory, {} where there is none."""
    path = directory / "settings.json"
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    if "arms" in recorded:
        recorded["arms"] = tuple(recorded["arms"])
    return recorded


def changed_settings(recorded: Mapping, given: Mapping, keys: tuple[str, ...]) -> list[str]:
    """'key (recorded -> given)' for each of `keys` given (not None) with a value other than the recorded one."""
    return [f"{k} ({recorded[k]!r} -> {given[k]!r})" for k in keys
            if given.get(k) is not None and k in recorded and recorded[k] != given[k]]


def source_settings(out: Path, given: Mapping) -> dict:
    """The settings a new experiment --from DIR starts from: DIR's; {} without --from. Refused where DIR is no
    experiment directory or where an option given differs from what DIR's data and SFT were made with."""
    if not given.get("from_dir"):
        return {}
    source = (out / given["from_dir"]).resolve()
    recorded = read_settings(source)
    if not recorded:
        raise StageError(f"--from {source}: no settings.json there, not an experiment directory of this script")
    changed = changed_settings(recorded, given, FROM_SETTINGS)
    if changed:
        raise StageError(f"--from {source}: its data and SFT were made with other settings: {', '.join(changed)}. "
                         "Drop those options (they are taken from there)")
    return recorded


def load_settings(out: Path, given: Mapping) -> Settings:
    """The recorded settings of `out` (for a new experiment --from DIR: DIR's) updated by the options given on the
    command line (None = not given); a given option that differs from the recorded one is refused, except those
    in MUTABLE."""
    recorded = read_settings(out)
    changed = changed_settings(recorded, given, tuple(k for k in given if k not in MUTABLE))
    if changed:
        raise StageError(f"{out} holds an experiment made with other settings: {', '.join(changed)}. "
                         "Use another --out, or drop those options")
    base = recorded or source_settings(out, given)
    return Settings(**{**base, **{k: v for k, v in given.items() if v is not None}})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["data", "sft", "wm", "ppo", "report", "all", "status"])
    parser.add_argument("--out", type=Path, required=True, help="experiment directory")
    defaults = Settings()
    for f in fields(Settings):
        flag = FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
        help_text = f"{HELP[f.name]} (default: {getattr(defaults, f.name)!r})"
        if f.name == "arms":
            parser.add_argument(flag, nargs="+", choices=list(ARMS), default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=type(getattr(defaults, f.name)), default=None,
                                help=help_text)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in fields(Settings)}
    if given["arms"] is not None:
        given["arms"] = tuple(given["arms"])
    if given["from_dir"]:  # recorded relative to --out, like the links
        given["from_dir"] = os.path.relpath(Path(given["from_dir"]).resolve(), args.out.resolve())
    try:
        settings = load_settings(args.out, given)
        exp = Experiment(args.out, settings)
        if args.stage == "status":
            print("\n".join(status_lines(exp)))
            return 0
        exp.link_source()
        exp.out.mkdir(parents=True, exist_ok=True)
        atomic_io.write_json(exp.out / "settings.json", asdict(settings))
        getattr(exp, f"stage_{args.stage}")()
    except StageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

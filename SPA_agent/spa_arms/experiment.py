"""One experiment directory of the three-arm study: its paths, the jobs of each stage (processes running the
commands of the pipeline's stage definition, SPA_agent/stages.py, with the study's settings) and the runner that
starts them, skipping what is complete."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from SPA_agent import stages
from SPA_agent.runs import atomic_io
from SPA_agent.selfplay import without_worldmodel
from SPA_agent.spa_arms.settings import ARMS, Settings, StageError

#: what --from DIR links into --out
LINKED = ("data", "data_nowm", "sft")
#: the checkout this package belongs to: its processes import the same code (PYTHONPATH)
REPO = Path(__file__).resolve().parents[2]


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
        from SPA_agent.runs.checkpoints import latest_step

        return latest_step(self.ppo_dir(arm))

    def ppo_done(self, arm: str) -> bool:
        return (self.ppo_step(arm) or 0) >= self.s.ppo_steps

    # ------------------------------------------------------------------ commands
    def _overrides(self, *extra: str) -> list[str]:
        return [o for text in (self.s.overrides, *extra) for o in shlex.split(text)]

    def data_job(self) -> Job:
        out = self.data_dir()
        return Job("data", [sys.executable, *stages.data_command(
            self.s.config, self.s.model, out, generator="random", batches=self.s.data_batches, resume=True,
            overrides=self._overrides(self.s.data_overrides))], lambda: (out / stages.CARD_FILE).is_file())

    def sft_job(self, arm: str) -> Job:
        from SPA_agent.runs.checkpoints import saved

        data, loss_target, _ = ARMS[arm]
        data_dir, out = self.out / data, self.sft_dir(arm)

        def record_checkpoint() -> None:
            checkpoint = saved(out)[-1][1].relative_to(self.out)  # relative: the directory may move
            atomic_io.write_json(self.sft_marker(arm), {"checkpoint": str(checkpoint)})

        return Job(f"sft-{arm}", [sys.executable, *stages.sft_command(
            data_dir, out, self.s.model,
            settings=["data.max_length=4096", f"trainer.experiment_name={arm}", "trainer.resume=auto",
                      f"data.loss_target={loss_target}", f"optim.lr={self.s.sft_lr}",
                      f"trainer.total_epochs={self.s.sft_epochs}", f"trainer.save_freq={self.s.sft_save_freq}",
                      "trainer.max_ckpt_to_keep=2"],
            overrides=shlex.split(self.s.sft_overrides))], self.sft_marker(arm).is_file, record_checkpoint)

    def ppo_job(self, arm: str, checkpoint: Path | None = None) -> Job:
        checkpoint = checkpoint or self.sft_checkpoint(arm)
        if checkpoint is None:
            raise StageError(f"arm {arm} has no SFT checkpoint ({self.sft_marker(arm)}): run the sft stage first")
        g = self.s.val_groups
        return Job(f"ppo-{arm}", [sys.executable, *stages.ppo_command(
            self.s.config, self.s.model, checkpoint, self.ppo_dir(arm), name=arm, steps=self.s.ppo_steps,
            save_freq=self.s.save_freq, resume_mode="auto",
            settings=["trainer.backend=local", f"trainer.test_freq={self.s.test_freq}",
                      "trainer.val_before_train=True", "trainer.validation_steps=1", "trainer.max_actor_ckpt_to_keep=2",
                      "trainer.max_critic_ckpt_to_keep=2", f"es_manager.val.env_groups={g}",
                      f"es_manager.val.group_size={self.s.val_group_size}",
                      f"es_manager.val.env_configs.n_groups=[{g}]"],
            overrides=self._overrides(self.s.ppo_overrides))], lambda: self.ppo_done(arm))

    def wm_job(self, arm: str, which: str, model_path: Path) -> Job:
        """Evaluation of `model_path`; complete once eval.json holds that model (a PPO run continued to more
        steps is evaluated again; compared below the experiment directory, which may move)."""
        out, relative = self.eval_dir(arm, which), model_path.relative_to(self.out)
        return Job(f"wm-{arm}-{which}", [sys.executable, *stages.evaluation_command(
            self.s.config, self.s.model, model_path, out,
            settings=["evaluation.prompt_mode=add_worldmodel", f"evaluation.num_puzzles={self.s.wm_puzzles}",
                      "evaluation.n=1", "evaluation.k=[1]", "evaluation.write_plots=false"],
            overrides=self._overrides(self.s.eval_overrides))],
            lambda: (result := read_eval(out)) is not None
            and Path(result["model_path"]).parts[-len(relative.parts):] == relative.parts)

    def planned_commands(self) -> list[list[str]]:
        """The command of every job of every stage, for checking their settings before the first one runs
        (SPA_agent/pipeline_check.py); checkpoints that the sft stage will make stand in for themselves."""
        stand_in = {arm: self.sft_dir(arm) / "global_step_N" for arm in self.s.arms}
        jobs = [self.data_job(), *(self.sft_job(arm) for arm in self.s.arms),
                *(self.ppo_job(arm, stand_in[arm]) for arm in self.s.arms),
                *(self.wm_job(arm, "sft", stand_in[arm]) for arm in self.s.arms)]
        return [job.argv for job in jobs]

    # ------------------------------------------------------------------ --from
    def link_source(self) -> None:
        """--from DIR: DIR's data, data_nowm and sft linked into this directory (relative links, so that the two
        directories may be moved or copied side by side); refused where DIR's data or SFT is incomplete for the
        arms, which the data and sft stages would otherwise continue inside DIR, or where this directory has a
        data or SFT of its own."""
        source = self.source_dir()
        if source is None:
            return
        needed = [source / "data" / stages.CARD_FILE, source / "data_nowm" / stages.CARD_FILE,
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
        missing = sorted({ARMS[arm][0] for arm in self.s.arms
                          if not (self.out / ARMS[arm][0] / stages.CARD_FILE).is_file()})
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

    def stage_ppo_beside_evaluations(self) -> None:
        """The PPO runs, and the evaluations of the SFT checkpoints in processes beside them."""
        jobs = [*self.ppo_jobs(), *self.wm_jobs()]
        run_jobs(self, jobs, limit=len(jobs))

def read_eval(out: Path) -> dict | None:
    """eval.json of a finished evaluation, None when absent or incomplete."""
    path = out / "eval.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text(encoding="utf-8"))
    return result if result.get("complete") else None


def write_without_worldmodel(source: Path, target: Path, settings: Settings) -> None:
    """DIR/data_nowm: every row of DIR/data as the base prompt mode shows it (SPA_agent.selfplay.without_worldmodel);
    kept where its data card is already there."""
    if (target / stages.CARD_FILE).is_file():
        return
    from SPA_agent.config import compose

    envs = compose(settings.config, [f"model={settings.model}", *shlex.split(settings.overrides)]).custom_envs
    counts = without_worldmodel.write_without_worldmodel(source, target, envs)
    print(f"data without world model written to {target} ({counts})", flush=True)


def run_jobs(exp: Experiment, jobs: list[Job], limit: int | None = None) -> None:
    """Run the jobs whose outputs are incomplete, at most `limit` (default --max-parallel) at a time; fail once
    they have all ended if any failed."""
    pending = [job for job in jobs if not job.done()]
    for job in jobs:
        if job not in pending:
            print(f"{job.name}: complete, skipped", flush=True)
    exp.logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONHASHSEED": stages.HASH_SEED,
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



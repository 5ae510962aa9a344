"""python -m SPA_agent.spa_arms (issue 13's three arms) end to end at CPU sizes on the tiny model: every stage, the
report's columns, the control arm's data, a rerun that skips everything, status lines and refused settings; then a
second experiment --from the first that runs only PPO from its SFT checkpoints."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from SPA_agent.evaluation.report import worldmodel_cell as _worldmodel_cell
from SPA_agent.evaluation.report import worldmodel_exact
from SPA_agent.spa_arms.experiment import Experiment, Job, run_jobs
from SPA_agent.spa_arms.settings import Settings, StageError
from SPA_agent.spa_arms.status import job_state

ARMS = ("spa", "nowm", "released")
TINY = [
    "--model", "tiny", "--data-batches", "1", "--ppo-steps", "1", "--test-freq", "1", "--save-freq", "1",
    "--val-groups", "2", "--val-group-size", "2", "--wm-puzzles", "1",
    "--overrides", "es_manager.train.env_groups=2 es_manager.train.group_size=2 es_manager.train.env_configs.n_groups=[2] "
    "agent_proxy.max_turn=2 ppo_mini_batch_size=2 micro_batch_size_per_gpu=2 "
    "actor_rollout_ref.rollout.rollout_filter_ratio=1 actor_rollout_ref.rollout.response_length=16",
    "--sft-overrides", "trainer.total_training_steps=1 data.train_batch_size=2 trainer.device=cpu",
]


def arms(stage, out, *args):
    return subprocess.run([sys.executable, "-m", "SPA_agent.spa_arms", stage, "--out", str(out), *args],
                          capture_output=True, text=True, check=False, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """A completed experiment (every stage, every arm), shared by the tests of this module."""
    out = tmp_path_factory.mktemp("spa") / "arms"
    result = arms("all", out, *TINY)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.mark.extended  # about 3 minutes with the next test (every stage of three arms): not in CI's default run
def test_three_arms_run_end_to_end_then_skip_on_rerun(experiment):
    out = experiment

    # Arm (b)'s data: the same trajectories and turns, no world-model blocks anywhere, base prompts.
    for split in ("wm_train", "wm_val"):
        wm, nowm = (pq.read_table(out / d / f"{split}.parquet").to_pylist() for d in ("data", "data_nowm"))
        assert len(wm) == len(nowm) > 0
        for a, b in zip(wm, nowm):
            assert (a["trajectory_id"], a["turn"], a["seed"]) == (b["trajectory_id"], b["turn"], b["seed"])
            assert "<observation>" in a["response"]
            text = b["response"] + "".join(m["content"] for m in b["prompt"])
            assert "<observation>" not in text and "<prediction>" not in text
            assert b["response"].endswith(a["response"][a["response"].index("<answer>"):])  # same actions

    # Every arm: an SFT checkpoint, a 1-step PPO run with validation at steps 0 and 1, world-model evaluations.
    report = json.loads((out / "report/report.json").read_text())
    for arm in ARMS:
        assert (out / json.loads((out / f"sft/{arm}.json").read_text())["checkpoint"] / "config.json").is_file()
        assert [p["step"] for p in report["arms"][arm]["validation"]] == [0, 1]
        assert report["arms"][arm]["episodes"] == 4
        assert [step for step, _ in report["arms"][arm]["entropy"]] == [1]
        for which in ("sft", "ppo"):
            assert json.loads((out / f"eval/{arm}/{which}/eval.json").read_text())["prompt_mode"] == "add_worldmodel"
            assert report["arms"][arm]["worldmodel"][which]["format"] is not None
        assert report["arms"][arm]["worldmodel"]["ppo"]["step"] == 1  # the actor evaluated: the last step's
    table = (out / "report/report.md").read_text()
    assert ("| arm | SFT init success (step 0) | final success | change (points) | intervals overlap | "
            "world model after SFT | world model after PPO | actor entropy (first → last step) |") in table
    assert "| step | spa | nowm | released |" in table and "\n| 1 | " in table
    assert (out / "report/arms.png").stat().st_size > 1000

    out = out.rename(out.with_name("moved"))  # the experiment directory may move (copied off a machine and back)
    try:
        check_rerun_status_and_refusal(out)
    finally:
        out.rename(experiment)


def check_rerun_status_and_refusal(out):
    rerun = arms("all", out)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # data, 3 SFT, 6 evaluations (the PPO runs are finished now), 3 PPO, 6 evaluations: nothing starts again.
    assert ": started (pid" not in rerun.stdout and rerun.stdout.count("complete, skipped") == 1 + 3 + 6 + 3 + 6

    status = arms("status", out).stdout.splitlines()
    assert len(status) == 2 + 3 + 3 + 6 + 1
    assert all("step 1/1" in line and line.split()[1] == "done;" for line in status if line.startswith("ppo/"))

    refused = arms("ppo", out, "--sft-lr", "1e-3")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "sft_lr (0.0005 -> 0.001)" in refused.stderr


def logged_argv(log):
    """The command line of the last process a job log records ('== <date> <time> <command>')."""
    header = [line for line in log.read_text().splitlines() if line.startswith("== ")][-1]
    return shlex.split(header)[3:]


@pytest.mark.extended
def test_from_runs_only_ppo_from_the_earlier_experiments_sft(experiment):
    """A GRPO sweep --from the completed experiment: its data and SFT are linked, not made again; its settings are
    inherited; PPO starts from its SFT checkpoint. One arm keeps it short."""
    new = experiment.with_name("arms_grpo")
    result = arms("all", new, "--from", str(experiment), "--arms", "spa", "--ppo-overrides", "algorithm.adv_estimator=grpo")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    assert {name: os.readlink(new / name) for name in ("data", "data_nowm", "sft")} == {
        name: f"../arms/{name}" for name in ("data", "data_nowm", "sft")}  # relative: the two may move side by side
    assert sorted(p.name for p in (new / "logs").glob("*.log")) == ["ppo-spa.log", "wm-spa-ppo.log", "wm-spa-sft.log"]
    assert "data: complete, skipped" in result.stdout and "sft-spa: complete, skipped" in result.stdout
    argv = logged_argv(new / "logs/ppo-spa.log")
    checkpoint = json.loads((experiment / "sft/spa.json").read_text())["checkpoint"]
    model_path = next(a.removeprefix("model_path=") for a in argv if a.startswith("model_path="))
    assert Path(model_path).resolve() == (experiment / checkpoint).resolve()
    assert argv[-1] == "algorithm.adv_estimator=grpo" and "model=tiny" in argv  # the model inherited from arms
    assert "adv_estimator: grpo" in (new / "ppo/spa/config.yaml").read_text()
    settings = json.loads((new / "settings.json").read_text())
    assert settings["from_dir"] == "../arms" and settings["arms"] == ["spa"]
    assert settings["overrides"] == json.loads((experiment / "settings.json").read_text())["overrides"]
    assert '"from_dir": "../arms"' in (new / "report/report.md").read_text()

    moved = experiment.parent.rename(experiment.parent.with_name("spa-moved"))  # both dirs, side by side
    try:
        status = arms("status", moved / "arms_grpo").stdout.splitlines()
        assert any(line.startswith("sft/spa") and "done" in line for line in status), status
    finally:
        moved.rename(experiment.parent)

    def refused(out, *args):
        result = arms("all", out, *args)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        return result.stderr

    base = experiment.parent
    assert "no settings.json there" in refused(base / "a", "--from", str(base / "none"))
    assert "sft_lr (0.0005 -> 0.001)" in refused(base / "b", "--from", str(experiment), "--sft-lr", "1e-3")
    assert not (base / "b").exists()
    incomplete = base / "incomplete"  # settings, but no data or SFT
    incomplete.mkdir()
    shutil.copy(experiment / "settings.json", incomplete)
    assert "not complete for arms spa" in refused(base / "c", "--from", str(incomplete), "--arms", "spa")
    (base / "d/data").mkdir(parents=True)  # an --out with data of its own
    assert "is not a link to" in refused(base / "d", "--from", str(experiment))
    assert "from_dir ('../arms' -> '../b')" in refused(new, "--from", str(base / "b"))  # --from cannot change


def test_jobs_run_in_parallel_on_their_devices_and_a_failure_is_reported_after_all_ended(tmp_path):
    exp = Experiment(tmp_path, Settings(max_parallel=2, devices="3,5"))
    show = "import os, sys; print(os.environ['CUDA_VISIBLE_DEVICES']); sys.exit({})"
    jobs = [Job(name, [sys.executable, "-c", show.format(rc)], lambda: False)
            for name, rc in (("a", 0), ("b", 1), ("c", 0))]
    with pytest.raises(StageError, match="^b failed"):
        run_jobs(exp, jobs)
    logs = {name: (tmp_path / f"logs/{name}.log").read_text().splitlines()[-1] for name in "abc"}
    assert logs == {"a": "3", "b": "5", "c": "3"}
    assert {name: (tmp_path / f"logs/{name}.rc").read_text() for name in "abc"} == {"a": "0", "b": "1", "c": "0"}
    assert [job_state(exp, name) for name in "ab"] == ["exited 0", f"failed (exit 1, {tmp_path}/logs/b.log)"]


def test_wm_stage_evaluates_the_last_saved_actor_of_an_unfinished_run(tmp_path):
    """A run that a lease ended before its last step: `all` (beside PPO) leaves it alone, the wm stage evaluates its
    last saved actor, and the report names that step."""
    from SPA_agent.runs.checkpoints import LATEST_FILE, TRAINER_STATE_FILE, step_dir

    exp = Experiment(tmp_path, Settings(arms=("spa",), ppo_steps=10))
    run = exp.ppo_dir("spa")
    step_dir(run, 3).mkdir(parents=True)
    (step_dir(run, 3) / TRAINER_STATE_FILE).write_bytes(b"")
    (run / LATEST_FILE).write_text("3")

    assert [job.name for job in exp.wm_jobs()] == []
    [job] = exp.wm_jobs(unfinished=True)
    assert job.name == "wm-spa-ppo" and f"model_path={run / 'global_step_3' / 'actor'}" in job.argv

    result = {"model_path": str(run / "global_step_3" / "actor"), "metrics": {"SimpleSokoban": {
        "worldmodel/format_rate": 1.0, "worldmodel/observation_exact": 0.5, "worldmodel/prediction_exact": 0.25}}}
    wm = worldmodel_exact(result)
    assert wm == {"format": 1.0, "observation": 0.5, "prediction": 0.25, "step": 3}
    assert _worldmodel_cell(wm, with_step=True) == "obs 0.500 / pred 0.250 (format 1.000, step 3)"
    assert worldmodel_exact(None)["step"] is None

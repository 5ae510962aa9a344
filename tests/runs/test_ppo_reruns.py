"""PPO reruns into an existing run directory: every mistake is refused before anything there is written."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from SPA_agent.config import compose
from SPA_agent.runs import checkpoints, run_identity
from SPA_agent.runs.dir_lock import LOCK_FILE, DirectoryLockedError, UnwritableDirectoryError
from SPA_agent.runs.metrics_logger import MetricsLogger, read_metrics
from SPA_agent.tiny import tiny_model_dir
from SPA_agent.trainer.main_ppo import RUN_DIR, run, run_identity_of

TINY = ["model=tiny", "es_manager.train.env_groups=2", "es_manager.train.env_configs.n_groups=[2]",
        "ppo_mini_batch_size=2", "trainer.total_training_steps=1", "trainer.test_freq=0"]


def config(run_dir: Path, *overrides: str):
    return compose("_2_sokoban", [*TINY, f"trainer.default_local_dir={run_dir}", *overrides])


@pytest.fixture
def finished_run(tmp_path):
    """A run directory as a finished run leaves it (identity of the TINY config, config, metrics, checkpoint)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_identity.record(run_dir, run_identity_of(config(run_dir)))
    (run_dir / "config.yaml").write_text("the finished run's config\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "global_step_1" / "actor").mkdir(parents=True)
    return run_dir


def contents(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_missing_corrupt_or_wrong_model_path_changes_nothing(finished_run, tmp_path):
    before = contents(finished_run)
    with pytest.raises(FileNotFoundError, match="model_path /nope does not exist"):
        run(config(finished_run, "model_path=/nope"))
    sft_root = tmp_path / "sft"
    shutil.copytree(tiny_model_dir(), sft_root / "global_step_3")
    with pytest.raises(FileNotFoundError, match="no config.json.*did you mean .*sft/global_step_3"):
        run(config(finished_run, f"model_path={sft_root}"))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir(), corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"cannot load the model {corrupt}"):
        run(config(finished_run, f"model_path={corrupt}", "trainer.resume_mode=disable"))
    assert contents(finished_run) == before


def test_other_settings_or_model_are_refused_naming_them(finished_run, tmp_path):
    before = contents(finished_run)
    with pytest.raises(run_identity.RunMismatchError,
                       match=r"actor_rollout_ref.actor.optim.lr \(1e-06 -> 1e-05\).*trainer.resume_mode=disable"):
        run(config(finished_run, "actor_rollout_ref.actor.optim.lr=1e-5"))
    other_model = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), other_model)
    (other_model / "generation_config.json").write_text("{}")
    with pytest.raises(run_identity.RunMismatchError, match=r"input model \(checksum differs\)"):
        run(config(finished_run, f"model_path={other_model}"))
    assert contents(finished_run) == before


def test_a_live_writer_or_an_unwritable_directory_is_refused(finished_run, tmp_path):
    (finished_run / LOCK_FILE).write_text(f'{{"pid": {os.getppid()}, "host": "{socket.gethostname()}", "started": 0}}')
    before = contents(finished_run)
    with pytest.raises(DirectoryLockedError, match=f"in use by pid {os.getppid()}"):
        run(config(finished_run))
    assert contents(finished_run) == before
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UnwritableDirectoryError, match="cannot write to"):
        run(config(tmp_path / "a_file" / "run"))


def test_fresh_run_removes_only_the_stage_outputs(finished_run):
    (finished_run / "notes.md").write_text("mine")
    checkpoints.staging_dir(finished_run, 2).mkdir()
    identity = run_identity_of(config(finished_run, "actor_rollout_ref.actor.optim.lr=1e-5"))
    RUN_DIR.reset(finished_run, identity)
    assert sorted(p.name for p in finished_run.iterdir()) == ["notes.md", run_identity.IDENTITY_FILE]
    assert run_identity.check(finished_run, identity, "x")


def test_settings_that_never_change_training_leave_the_identity_alone(tmp_path):
    base = run_identity_of(config(tmp_path))
    for setting in ("trainer.log_val_generations=8", "trainer.stop_after_uniform_scores=20", "trainer.max_wall_s=60",
                    "trainer.diagnostics.mi_freq=0"):
        assert run_identity_of(config(tmp_path, setting)) == base, setting
    assert run_identity_of(config(tmp_path, "trainer.seed=1")) != base


def test_more_steps_continue_a_run_unless_the_schedule_depends_on_them(tmp_path):
    base = run_identity_of(config(tmp_path))
    assert run_identity_of(config(tmp_path, "trainer.total_training_steps=5")) == base
    warmup = ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",)
    assert run_identity_of(config(tmp_path, *warmup)) != run_identity_of(
        config(tmp_path, *warmup, "trainer.total_training_steps=5"))


def test_cut_short_last_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    logger = MetricsLogger(tmp_path, [], "project", "experiment", {})
    logger.truncate_after(2)
    logger.log({"a": 3.0}, step=3)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON line"):
        read_metrics(path)

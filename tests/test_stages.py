"""The stage definition (SPA_agent/stages.py): the files between the stages and each stage's command line."""

from __future__ import annotations

import subprocess
import sys

from SPA_agent import stages
from SPA_agent.pipeline_check import STAGES as CHECKED


def test_the_files_between_data_and_sft_are_the_splits_as_parquet():
    assert stages.DATA_FILES == ("wm_train.parquet", "wm_val.parquet") == (stages.TRAIN_FILE, stages.VAL_FILE)
    assert [f"{split}.parquet" for split in stages.SPLITS] == list(stages.DATA_FILES)


def test_a_paths_written_form_is_kept_in_the_file_names():
    """The overrides name the data as the user wrote its directory: the SFT run records that text."""
    command = stages.sft_command("./d/", "out", "tiny")
    assert command[:4] == ["-m", "sft.spa_sft_trainer", "data.train_files=./d//wm_train.parquet",
                           "data.val_files=./d//wm_val.parquet"]


def test_user_overrides_come_last_in_every_stage():
    commands = [stages.data_command("_2_sokoban", "tiny", "d", generator="random", settings=["s=1"], overrides=["u=1"]),
                stages.sft_command("d", "s", "tiny", settings=["s=1"], overrides=["u=1"]),
                stages.ppo_command("_2_sokoban", "tiny", "m", "r", name="n", steps=2, save_freq=1, resume_mode="auto",
                                   settings=["s=1"], overrides=["u=1"]),
                stages.evaluation_command("_2_sokoban", "tiny", "m", "e", settings=["s=1"], overrides=["u=1"])]
    for command in commands:
        assert command[-1] == "u=1" and command.index("s=1") < command.index("u=1")


def test_the_data_stage_leaves_unset_batches_and_resume_to_the_config():
    command = stages.data_command("_2_sokoban", "tiny", "d", generator="random")
    assert not any(a.startswith(("data_gen.num_batches=", "data_gen.resume=")) for a in command)
    command = stages.data_command("_2_sokoban", "tiny", "d", generator="random", batches=2, resume=False)
    assert "data_gen.num_batches=2" in command and "data_gen.resume=false" in command


def test_more_than_one_gpu_runs_the_verl_backend():
    assert stages.backend_settings(0) == ["trainer.backend=local", "trainer.n_gpus_per_node=1"]
    assert stages.backend_settings(4, "2") == ["trainer.backend=verl",
                                               "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                               "trainer.n_gpus_per_node=4"]


def test_every_checked_stage_is_a_stage_in_pipeline_order():
    modules = [stage.module for stage in stages.STAGES]
    assert list(CHECKED) == [m for m in modules if m in CHECKED] and len(CHECKED) == 4


def test_the_script_names_of_a_run():
    names = stages.script_names("_2_sokoban", "tiny", "text", "spa", "./checkpoints",
                                start="sft/global_step_6", data_suffix="-x")
    assert names == {"DEFAULT_OUTPUT_DIR": "./sftdata/_2_sokoban-tiny-text-x",
                     "DEFAULT_CHECKPOINT_DIR": "./sftckpt/checkpoints_2_sokoban-tiny-text-tiny",
                     "EXPERIMENT_NAME": "_2_sokoban-tiny-text-spa-global_step_6",
                     "RUN_DIR": "./checkpoints/_2_sokoban/_2_sokoban-tiny-text-spa-global_step_6",
                     "DEFAULT_EVAL_DIR": "./evals/_2_sokoban-tiny-text-spa-global_step_6"}


def test_the_scripts_sft_stage_takes_the_model_size_table():
    out = stages.script_sft_command("_2_sokoban", "s", "d", "llama1B", "disable", ["x=1"])
    assert "model.partial_pretrain=meta-llama/Llama-3.2-1B-Instruct" in out and "data.max_length=2048" in out
    assert "trainer.experiment_name=_2_sokoban-sft-llama-3.2-llama1B-instruct" in out
    assert out[-2:] == ["data.config_name=_2_sokoban", "x=1"]  # the data card is checked for an entry config


def test_the_command_line_errors_are_one_line(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "SPA_agent.stages", *args], capture_output=True, text=True,
                              check=False)

    base = ["sft", "--env-type=_2_sokoban", "--save-dir=s", f"--data-dir={tmp_path}", "--resume=auto"]
    result = run(*base, "--nproc=1", "--model-size=7B")
    assert result.returncode == 2 and result.stderr.startswith("error: unknown model size '7B'")
    result = run(*base, "--nproc=01", "--model-size=tiny")
    assert result.returncode == 2 and result.stderr == "error: nproc_per_node must be a positive integer, got '01'\n"
    result = run(*base, "--nproc=1", "--model-size=tiny", "--check-data")
    assert result.stderr == f"error: {tmp_path}/wm_train.parquet not found: run stage 1 first or fix <data_path>\n"
    result = run(*base, "--nproc=1", "--model-size=tiny", "--", "a=1")
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "a=1"

"""Weak answers to user mistakes (issue 44, "Weak"): each is refused in one line naming the key typed (exit status 2)
before any model is loaded or file written, or handled as the user needs; progress and Ctrl-C lines as elsewhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sft"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from entry_calls import must_not_run, run_entry  # noqa: E402
from sft_fixtures import synthetic_rows, write_rows  # noqa: E402

from SPA_agent.config import compose  # noqa: E402
from SPA_agent.entry import EXIT_INTERRUPTED, EXIT_USAGE  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = ["--config-name", "_2_sokoban", "model=tiny"]
RENDER_MODES = "('text', 'text_with_coordinates')"
PROMPT_MODES = "('base', 'add_worldmodel')"


def stages():
    """(module, the name of the function doing its work) of data generation, evaluation and PPO."""
    from SPA_agent import evaluate, generate_sft_data
    from SPA_agent.trainer import main_ppo

    return {"G": (generate_sft_data, "generate"), "E": (evaluate, "evaluate"), "P": (main_ppo, "load_backend")}


def sft_data(root: Path, train_rows: int = 8, val_rows: int = 4) -> Path:
    """A complete (carded) SFT dataset of hand-written rows."""
    root.mkdir(parents=True, exist_ok=True)
    write_rows(root / "wm_train.parquet", *synthetic_rows(train_rows, seed=0))
    write_rows(root / "wm_val.parquet", *synthetic_rows(val_rows, seed=1))
    (root / "data_card.json").write_text("{}")
    return root


def sft_overrides(data: Path, out: Path, *extra: str) -> list[str]:
    return [f"data.train_files={data}/wm_train.parquet", f"data.val_files={data}/wm_val.parquet",
            "model.partial_pretrain=tiny", f"trainer.default_local_dir={out}", "data.max_length=96",
            "data.train_batch_size=4", "data.max_tokens_per_micro_batch=192", "trainer.total_training_steps=1",
            "trainer.device=cpu", *extra]


# --- 1. val_fraction=0: an empty wm_val.parquet, which SFT takes as "no validation" --------------------------------
def test_sft_trains_without_validation_on_data_made_with_val_fraction_0(tmp_path, capsys):
    from sft.in_process import compose as sft_compose
    from sft.in_process import run
    from SPA_agent.selfplay.generate import generate, prepare_data_gen_config

    data = tmp_path / "data"
    generate(prepare_data_gen_config(compose("_2_sokoban", [
        "model=tiny", "generator=random", "data_gen.num_batches=1", "data_gen.val_fraction=0",
        "agent_proxy.max_turn=1", "actor_rollout_ref.rollout.response_length=8", f"data_gen.output_dir={data}"]), "_2_sokoban"))
    card = json.loads((data / "data_card.json").read_text())
    assert card["num_val"] == 0 and card["num_train"] > 0
    capsys.readouterr()
    out = tmp_path / "sft"
    run(sft_compose(sft_overrides(data, out, "data.max_length=256", "data.max_tokens_per_micro_batch=1024")))
    printed = capsys.readouterr().out
    assert (f"sft data val: {data}/wm_val.parquet has no rows (made with data_gen.val_fraction=0?): no validation "
            "loss\n") in printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and "val/loss" not in records[0]
    assert (out / "global_step_1" / "model.safetensors").is_file()


# --- 2, 3. PPO's env groups and tags, named by the key typed, before any model is loaded ------------------------------
@pytest.mark.parametrize("override, message", [
    ("es_manager.train.group_size=0", "es_manager.train.group_size must be an integer >= 1, got 0"),
    ("es_manager.train.env_groups=0", "es_manager.train.env_groups must be an integer >= 1, got 0"),
    ("es_manager.val.group_size=two", "es_manager.val.group_size must be an integer >= 1, got 'two'"),
    ("es_manager.val.env_configs.tags=[SimpleSokobn]",
     "es_manager.val.env_configs.tags: unknown env tag 'SimpleSokobn' (did you mean SimpleSokoban?); known tags: "),
])
def test_ppo_refuses_bad_env_groups_by_the_key_typed_before_loading_models(monkeypatch, capsys, tmp_path,
                                                                           override, message):
    from SPA_agent.trainer import main_ppo

    monkeypatch.setattr(main_ppo, "load_backend", must_not_run)
    code = run_entry(monkeypatch, main_ppo, [*TINY, "model_path=tiny", f"trainer.default_local_dir={tmp_path / 'p'}",
                                             override])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "p").exists()


# --- 4, 5. render and prompt modes: one line listing the valid ones, named by the key typed, at every stage ----------
@pytest.mark.parametrize("stage", ["G", "E", "P"])
def test_an_unknown_render_mode_is_one_line_listing_the_valid_modes(monkeypatch, capsys, tmp_path, stage):
    module, work = stages()[stage]
    monkeypatch.setattr(module, work, must_not_run)
    code = run_entry(monkeypatch, module, [*TINY, "render_mode=txt", f"output_root={tmp_path}"])
    assert code == EXIT_USAGE
    assert capsys.readouterr().err == f"error: render_mode must be one of {RENDER_MODES}, got 'txt'\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stage, key", [("G", "data_gen.prompt_mode"), ("E", "evaluation.prompt_mode"),
                                        ("P", "ctx_manager.mode")])
def test_an_unknown_prompt_mode_names_the_key_typed(monkeypatch, capsys, tmp_path, stage, key):
    module, work = stages()[stage]
    monkeypatch.setattr(module, work, must_not_run)
    code = run_entry(monkeypatch, module, [*TINY, f"{key}=foo", f"output_root={tmp_path}"])
    assert code == EXIT_USAGE
    assert capsys.readouterr().err == f"error: {key} must be one of {PROMPT_MODES}, got 'foo'\n"


# --- 6. Hydra's composition errors: one line with the close matches, at every entry point ----------------------------
def sft_main():
    from sft import spa_sft_trainer

    return spa_sft_trainer


@pytest.mark.parametrize("stage", ["G", "E", "P"])
@pytest.mark.parametrize("argv, expected", [
    (["--config-name", "_2_sokobn"], "error: unknown config name '_2_sokobn' (did you mean _2_sokoban?); choose one of "),
    ([*TINY, "evaluaton.n=2"], "error: unknown key 'evaluaton.n' in evaluaton.n=2 (did you mean evaluation.n?); "
                               "+evaluaton.n=2 adds a new key"),
    ([*TINY, "experiment=spa_grp"], "error: unknown experiment 'spa_grp' (did you mean spa_grpo?); choose one of "
                                    "easy_to_hard, "),
    ([*TINY, "model=tny"], "error: unknown model 'tny' (did you mean tiny?); choose one of "),
])
def test_composition_errors_are_one_line_with_the_close_matches(monkeypatch, capsys, stage, argv, expected):
    module, work = stages()[stage]
    monkeypatch.setattr(module, work, must_not_run)
    code = run_entry(monkeypatch, module, argv)
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.startswith(expected) and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, expected", [
    (["--config-name", "sft_trainr"], "error: unknown config name 'sft_trainr' (did you mean sft_trainer?); "
                                      "choose one of sft_trainer\n"),
    (["optim.lrr=1"], "error: unknown key 'optim.lrr' in optim.lrr=1 (did you mean optim.lr?); +optim.lrr=1 adds a "
                      "new key\n"),
])
def test_sft_composition_errors_are_one_line(monkeypatch, capsys, argv, expected):
    module = sft_main()
    monkeypatch.setattr(module.SftTrainer, "preflight", must_not_run)
    assert run_entry(monkeypatch, module, argv) == EXIT_USAGE and capsys.readouterr().err == expected


def test_compose_raises_the_same_one_line_error():
    with pytest.raises(ValueError, match=r"^unknown key 'evaluation.nn' in evaluation.nn=2 \(did you mean "
                                         r"evaluation.n"):
        compose("_2_sokoban", ["evaluation.nn=2"])


# --- 7, 8. SFT step settings that were ignored silently -------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("trainer.total_training_steps=0", "trainer.total_training_steps must be an integer >= 1 or null (total_epochs "
                                       "worth), got 0"),
    ("trainer.total_training_steps=-3", "trainer.total_training_steps must be an integer >= 1 or null (total_epochs "
                                        "worth), got -3"),
    ("trainer.save_freq=-2", "trainer.save_freq must be an integer >= 0 or null (0 and null: at the end of each epoch "
                             "only), got -2"),
])
def test_sft_refuses_step_settings_it_used_to_ignore(monkeypatch, capsys, tmp_path, override, message):
    """What sft/finetune_ft.sh runs first (the check for one rank): one line, exit 2, nothing written."""
    module = sft_main()
    data, out = sft_data(tmp_path / "data"), tmp_path / "sft"
    code = run_entry(monkeypatch, module, [*sft_overrides(data, out), override, "trainer.preflight_nproc=1"])
    assert code == EXIT_USAGE and capsys.readouterr().err == f"error: {message}\n"
    assert not out.exists()


# --- 9. a damaged data shard is named ---------------------------------------------------------------------------------
def test_a_truncated_partial_shard_is_named_with_what_to_do(monkeypatch, capsys, tmp_path):
    from SPA_agent import generate_sft_data
    from SPA_agent.rollout.agent_proxy import LLMAgentProxy

    out = tmp_path / "data"
    argv = [*TINY, "generator=random", "data_gen.num_batches=2", "agent_proxy.max_turn=1",
            "actor_rollout_ref.rollout.response_length=8", f"data_gen.output_dir={out}"]
    real_rollout, calls = LLMAgentProxy.rollout, []

    def rollout_then_interrupt(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_rollout(self, *args, **kwargs)

    monkeypatch.setattr(LLMAgentProxy, "rollout", rollout_then_interrupt)
    assert run_entry(monkeypatch, generate_sft_data, argv) == EXIT_INTERRUPTED
    shard = out / ".partial" / "batch_00000.json"
    shard.write_text(shard.read_text()[:100])  # cut short
    capsys.readouterr()
    assert run_entry(monkeypatch, generate_sft_data, argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: {shard} is damaged (not JSON: ") and err.count("\n") == 1, err
    assert err.endswith("delete it to play that batch again, or pass data_gen.resume=false to start over\n")
    assert sorted(p.name for p in out.iterdir()) == [".partial"]


# --- 10. Ctrl-C in SFT: one line saying what was kept, exit 130 ----------------------------------------------------
def test_ctrl_c_in_an_sft_rank_is_one_line_and_status_130(monkeypatch, capsys, tmp_path):
    module = sft_main()
    data, out = sft_data(tmp_path / "data"), tmp_path / "sft"

    def interrupt(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module.SftTrainer, "train", interrupt)
    assert run_entry(monkeypatch, module, sft_overrides(data, out)) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == f"interrupted: no checkpoint was saved yet in {out}; run the same command again\n"
    assert not (out / ".lock").exists()  # the lock is released
    (out / "global_step_2").mkdir()
    assert run_entry(monkeypatch, module, sft_overrides(data, out)) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == (
        f"interrupted: the checkpoints saved so far are in {out} (latest global_step_2); the same command with "
        "trainer.resume=auto (RESUME=1 in finetune_ft.sh) continues from the latest\n")


def test_the_sft_launcher_ends_quietly_with_the_signal_status(monkeypatch, capsys):
    """torchrun forwards Ctrl-C to the ranks (which say what was kept), then raises; the launcher exits 130 without
    torchrun's traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from sft import launch

    def torchrun(*args, **kwargs):
        raise SignalException("Process 1 got signal: 2", sigval=signal.SIGINT)

    monkeypatch.setattr(launch, "torchrun", torchrun)
    with pytest.raises(SystemExit) as exit_info:
        launch.main([])
    assert exit_info.value.code == EXIT_INTERRUPTED and capsys.readouterr() == ("", "")


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_running_finetune_ft_sh(tmp_path):
    """Ctrl-C reaches the terminal's foreground process group (the script, torchrun, tee): the log and the terminal
    get the rank's one line, not a `^C` alone or tracebacks; exit status 130."""
    data, out = sft_data(tmp_path / "data", train_rows=64), tmp_path / "sft"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        ["bash", str(REPO / "sft/finetune_ft.sh"), "_2_sokoban", "1", str(out), str(data), "tiny", "data.max_length=96",
         "data.train_batch_size=4", "data.max_tokens_per_micro_batch=192", "trainer.save_freq=1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not list(out.glob("global_step_*")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    interrupted = [line for line in output.splitlines() if line.startswith("interrupted:")]
    assert process.returncode == EXIT_INTERRUPTED, output[-3000:]
    assert len(interrupted) == 1 and "continues from the latest" in interrupted[0], output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output and "death signal" not in output
    assert interrupted[0] in (out / "train.log").read_text()


# --- 11. an evaluation directory holding another model's evaluation ------------------------------------------------
def test_evaluation_refuses_to_replace_another_models_evaluation(monkeypatch, capsys, tmp_path):
    from SPA_agent import evaluate

    out = tmp_path / "eval"
    out.mkdir()
    other = {"complete": True, "model_path": "/models/other/global_step_5", "model_name": "other-global_step_5"}
    (out / "eval.json").write_text(json.dumps(other))
    small = [*TINY, "generator=random", "evaluation.num_puzzles=1", "evaluation.n=1", "agent_proxy.max_turn=1",
             "actor_rollout_ref.rollout.response_length=8", "evaluation.write_plots=false",
             f"evaluation.output_dir={out}"]
    monkeypatch.setattr("SPA_agent.evaluation.evaluate.load_tokenizer", must_not_run)
    assert run_entry(monkeypatch, evaluate, small) == EXIT_USAGE
    assert capsys.readouterr().err == (
        f"error: {out} holds the evaluation of another model (other-global_step_5: /models/other/global_step_5); "
        "pass evaluation.overwrite=true to replace it, or choose another evaluation.output_dir\n")
    assert sorted(p.name for p in out.iterdir()) == ["eval.json"]
    monkeypatch.undo()
    monkeypatch.setattr(sys, "argv", ["evaluate", *small, "evaluation.overwrite=true"])
    evaluate.main()  # replaced as asked; then the same model again needs no flag
    assert json.loads((out / "eval.json").read_text())["model_name"] == "random"  # evaluations of the random generator are named after it
    monkeypatch.setattr(sys, "argv", ["evaluate", *small])
    evaluate.main()


# --- 12. the SmolLM2 conversion in a redirected log -------------------------------------------------------------
def test_the_smollm2_conversion_writes_plain_lines_to_a_log(capfd, tmp_path):
    from test_smollm2 import write_tiny_gguf

    from SPA_agent import smollm2
    from SPA_agent.tiny import tiny_model_dir

    gguf = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(gguf, tiny_model_dir())
    capfd.readouterr()
    smollm2.convert_gguf(gguf, tmp_path / "model")
    out, err = capfd.readouterr()
    assert "\r" not in out + err and "\x1b[" not in out + err
    assert err.startswith(f"{smollm2.NAME}: reading {gguf} (de-quantizing its tensors)\n"), err


# --- 13. SFT's redirected progress: a line at least every HEARTBEAT_S, also during a long step --------------------
def test_a_long_sft_step_prints_heartbeat_lines_when_redirected(monkeypatch, capfd, tmp_path):
    from sft import spa_sft_trainer
    from sft.in_process import compose as sft_compose
    from sft.in_process import run
    from SPA_agent.runs import progress

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.1)
    real_step = spa_sft_trainer.SftTrainer.train_step

    def slow_step(self, indices):
        time.sleep(0.5)
        return real_step(self, indices)

    monkeypatch.setattr(spa_sft_trainer.SftTrainer, "train_step", slow_step)
    data, out = sft_data(tmp_path / "data"), tmp_path / "sft"
    run(sft_compose(sft_overrides(data, out)))
    captured = capfd.readouterr()
    beats = [line for line in captured.err.splitlines() if line.startswith("sft: step 1/1 running (")]
    assert len(beats) >= 2 and "\r" not in captured.err, captured.err
    assert "step 1/1: loss " in captured.out


def test_the_heartbeat_thread_is_quiet_after_a_line_and_on_a_terminal(monkeypatch, capsys):
    from SPA_agent.runs import progress

    with progress.BackgroundHeartbeat("working", interval_s=0.05):
        time.sleep(0.17)
    beats = capsys.readouterr().err.splitlines()
    assert 2 <= len(beats) <= 4 and set(beats) == {"working (0 s)"}
    with progress.BackgroundHeartbeat("working", interval_s=0.2) as heartbeat:
        for _ in range(4):
            time.sleep(0.1)
            heartbeat.mark()  # the loop printed its own line
    assert capsys.readouterr().err == ""
    with progress.BackgroundHeartbeat("working", interval_s=0.05, disable=True):
        time.sleep(0.12)
    monkeypatch.setattr(progress, "is_terminal", lambda stream=None: True)
    with progress.BackgroundHeartbeat("working", interval_s=0.05):
        time.sleep(0.12)
    assert capsys.readouterr().err == ""


# --- 14. spa_arms status of a directory that holds no experiment ------------------------------------------------
@pytest.mark.parametrize("make", [False, True])
def test_spa_arms_status_of_no_experiment_is_one_line_and_exit_2(capsys, tmp_path, make):
    from SPA_agent.spa_arms.__main__ import main

    out = tmp_path / "arms"
    if make:
        out.mkdir()
    assert main(["status", "--out", str(out)]) == EXIT_USAGE
    reason = "holds no spa_arms experiment (no settings.json)" if make else "does not exist"
    assert capsys.readouterr() == ("", f"error: {out} {reason}; start one with python -m SPA_agent.spa_arms all "
                                       f"--out {out}\n")
    assert out.exists() == make and (not make or list(out.iterdir()) == [])

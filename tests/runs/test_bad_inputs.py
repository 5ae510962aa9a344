"""Bad settings and Ctrl-C at the entry points (issue 29): one line on stderr and the documented exit status,
before any batch, rollout or training step."""

from __future__ import annotations

import pytest
from entry_calls import must_not_run, run_entry

from SPA_agent.config import compose
from SPA_agent.entry import EXIT_INTERRUPTED, EXIT_USAGE
from SPA_agent.evaluation.evaluate import default_ks, prepare_eval_config
from SPA_agent.selfplay.generate import prepare_data_gen_config
from SPA_agent.trainer.config_checks import check_config


@pytest.mark.parametrize("value, message", [
    ("1.5", "data_gen.val_fraction must be in [0, 1), got 1.5"),
    ("1", "data_gen.val_fraction must be in [0, 1), got 1"),
    ("abc", "data_gen.val_fraction must be a number, got 'abc'"),
])
def test_data_generation_refuses_a_bad_val_fraction_before_the_first_batch(monkeypatch, capsys, value, message):
    from SPA_agent import generate_sft_data

    monkeypatch.setattr(generate_sft_data, "generate", must_not_run)
    code = run_entry(monkeypatch, generate_sft_data, ["--config-name", "_2_sokoban", "model=tiny",
                                                      f"data_gen.val_fraction={value}"])
    assert code == EXIT_USAGE and capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("override, message", [
    ("data_gen.split_by=turn", "data_gen.split_by must be one of ('trajectory', 'row'), got 'turn'"),
    ("data_gen.split_seed=-1", "data_gen.split_seed must be >= 0, got -1"),
    ("data_gen.num_batches=0", "data_gen.num_batches must be >= 1, got 0"),
    ("data_gen.write_csv=maybe", "data_gen.write_csv must be true or false, got 'maybe'"),
])
def test_every_data_gen_setting_is_checked_up_front(override, message):
    with pytest.raises(ValueError, match=f"^{message.replace('(', '.').replace(')', '.')}$"):
        prepare_data_gen_config(compose("_2_sokoban", ["model=tiny", override]), "_2_sokoban")


MESSAGE = "actor_rollout_ref.rollout.response_length must be >= 1, got 0"


def test_a_zero_response_length_is_refused_by_every_stage():
    overrides = ["model=tiny", "actor_rollout_ref.rollout.response_length=0"]
    with pytest.raises(ValueError, match=f"^{MESSAGE}$"):
        prepare_data_gen_config(compose("_2_sokoban", overrides), "_2_sokoban")
    with pytest.raises(ValueError, match=f"^{MESSAGE}$"):
        prepare_eval_config(compose("_2_sokoban", overrides), "_2_sokoban")
    with pytest.raises(ValueError, match=f"^{MESSAGE}$"):
        check_config(compose("_2_sokoban", overrides))


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_evaluation_refuses_a_bad_num_puzzles_by_the_key_typed(monkeypatch, capsys, value):
    from SPA_agent import evaluate

    monkeypatch.setattr(evaluate, "evaluate", must_not_run)
    code = run_entry(monkeypatch, evaluate, ["--config-name", "_2_sokoban", "model=tiny",
                                             f"evaluation.num_puzzles={value}"])
    expected = "must be an integer, got 'two'" if value == "two" else f"must be >= 1, got {value}"
    assert code == EXIT_USAGE and capsys.readouterr().err == f"error: evaluation.num_puzzles {expected}\n"


@pytest.mark.parametrize("n, ks", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 9])])
def test_the_default_k_follows_n(n, ks):
    assert default_ks(n) == ks
    cfg = prepare_eval_config(compose("_2_sokoban", [f"evaluation.n={n}"]), "_2_sokoban")
    assert list(cfg.evaluation.k) == ks and cfg.es_manager.val.group_size == n


def test_an_explicit_k_above_n_is_still_refused():
    with pytest.raises(ValueError, match=r"^evaluation.k=\[1, 4\] must lie in \[1, evaluation.n=2\]"):
        prepare_eval_config(compose("_2_sokoban", ["evaluation.n=2", "evaluation.k=[1,4]"]), "_2_sokoban")


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_ctrl_c_in_data_generation_is_one_line_and_status_130(monkeypatch, capsys, tmp_path):
    from SPA_agent import generate_sft_data

    monkeypatch.setattr(generate_sft_data, "generate", interrupt)
    code = run_entry(monkeypatch, generate_sft_data, ["--config-name", "_2_sokoban", "model=tiny",
                                                      f"data_gen.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == EXIT_INTERRUPTED == 130
    assert err == (f"interrupted: finished batches are kept in {tmp_path}/.partial; the same command continues "
                   "after them (data_gen.resume=true; RESUME=1 in the scripts)\n")


def test_ctrl_c_in_ppo_is_one_line_and_status_130(monkeypatch, capsys, tmp_path):
    from SPA_agent.trainer import main_ppo

    monkeypatch.setattr(main_ppo, "run", interrupt)
    code = run_entry(monkeypatch, main_ppo, ["--config-name", "_2_sokoban", "model=tiny",
                                             f"trainer.default_local_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == EXIT_INTERRUPTED
    assert err == (f"interrupted: the checkpoints saved so far are in {tmp_path}; the same command with "
                   "trainer.resume_mode=auto (RESUME=1 in the scripts) continues from the latest\n")


def test_redirected_evaluation_prints_a_line_per_turn(tmp_path, capsys):
    from SPA_agent.evaluation.evaluate import evaluate

    cfg = prepare_eval_config(compose("_2_sokoban", [
        "model=tiny", "generator=random", "evaluation.num_puzzles=2", "agent_proxy.max_turn=2",
        "actor_rollout_ref.rollout.response_length=8", "evaluation.write_plots=false",
        f"evaluation.output_dir={tmp_path}"]), "_2_sokoban")
    evaluate(cfg)
    err = capsys.readouterr().err
    assert err == "val rollout turns 1/2 done (0 s)\nval rollout turns 2/2 done (0 s)\n"


def test_ppo_reports_each_phase_of_a_step_as_it_ends(capsys):
    from SPA_agent.trainer.metrics import PhaseTimer
    from SPA_agent.trainer.ppo_trainer import _report_phase

    timer = PhaseTimer(report=lambda phase, seconds: _report_phase(3, phase, round(seconds)))
    with timer("step"):
        with timer("gen"):
            pass
        with timer("update_actor"):
            pass
    assert capsys.readouterr().err == "step 3: gen done (0.0 s)\nstep 3: update_actor done (0.0 s)\n"
    assert set(timer.metrics()) == {"timing_s/step", "timing_s/gen", "timing_s/update_actor"}


@pytest.fixture
def quiet_libraries():
    """The entry points' `quiet_library_progress` (pytest captures stderr: not a terminal), undone afterwards."""
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging

    from SPA_agent.runs.progress import quiet_library_progress

    quiet_library_progress()
    yield
    enable_progress_bars()
    logging.enable_progress_bar()


def test_a_redirected_critic_load_says_in_one_line_that_its_value_head_is_new(quiet_libraries, capfd, tiny_dir):
    import torch
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging

    from SPA_agent.trainer.local_backend.models import load_critic

    assert are_progress_bars_disabled() and not logging.is_progress_bar_enabled()
    load_critic(str(tiny_dir), torch.device("cpu"), gradient_checkpointing=False)
    out, err = capfd.readouterr()
    assert out == ("critic: new value head (score.bias, score.weight) initialised, as intended for a critic started "
                   "from a language model\n")
    assert err == ""  # no "MISSING" load report, no carriage-return "Loading weights" bar


def test_ctrl_c_in_evaluation_is_one_line_and_status_130(monkeypatch, capsys):
    from SPA_agent import evaluate

    monkeypatch.setattr(evaluate, "evaluate", interrupt)
    code = run_entry(monkeypatch, evaluate, ["--config-name", "_2_sokoban", "model=tiny"])
    assert code == EXIT_INTERRUPTED and capsys.readouterr().err == (
        "interrupted: nothing was written (an evaluation is saved once complete); run the same command again\n")

"""The pipeline scripts end to end with MODEL=tiny, and their one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / script), *args], capture_output=True, text=True, check=False,
                          env={**os.environ, "MODEL": "tiny", **(env or {})}, timeout=timeout)


@pytest.mark.slow
def test_run_spa_chains_data_sft_ppo_and_evaluation(tmp_path):
    dirs = {"OUTPUT_DIR": tmp_path / "data", "CHECKPOINT_DIR": tmp_path / "sft", "BASE_DIR": tmp_path / "ppo",
            "EVAL_DIR": tmp_path / "evals"}
    env = {**{k: str(v) for k, v in dirs.items()}, "BT_NUM": "2", "TOTAL_STEPS": "1",
           "SFT_OVERRIDES": "optim.lr=1e-3 trainer.total_epochs=1 data.max_tokens_per_micro_batch=2048"}
    # A named evaluation variant: SPA on FrozenLake 4x4, evaluated on 6x6 (the default experiment is `spa`).
    result = _run("run_spa.sh", "_3_frozen_lake", "last", "True", "trainer.test_freq=0", "experiment=easy_to_hard",
                  env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (dirs["OUTPUT_DIR"] / "wm_train.parquet").is_file() and (dirs["OUTPUT_DIR"] / "data_card.json").is_file()
    sft_steps = sorted(dirs["CHECKPOINT_DIR"].glob("global_step_*"))
    assert sft_steps and (sft_steps[-1] / "config.json").is_file()
    runs = list((dirs["BASE_DIR"] / "_3_frozen_lake").iterdir())
    assert len(runs) == 1 and runs[0].name.endswith(f"easy_to_hard-{sft_steps[-1].name}")
    card = json.loads((dirs["OUTPUT_DIR"] / "data_card.json").read_text())
    assert card["format_filter"] is True and card["env_tags"] == ["FrozenLake"]
    assert (runs[0] / "global_step_1" / "actor" / "config.json").is_file()
    for which in ("before_ppo", "after_ppo"):
        report = json.loads((dirs["EVAL_DIR"] / which / "eval.json").read_text())
        assert list(report["metrics"]) == ["FrozenLake6x6"] and report["complete"] is True
    summary = (dirs["EVAL_DIR"] / "summary.md").read_text()
    assert "before_ppo" in summary and "after_ppo" in summary and "reported, not measured here" in summary
    assert "easy_to_hard" in summary and "Fig. 9: Easy2Hard SPA" in summary
    assert "== done. Outputs:" in result.stdout
    # Issue 14, case 1: rerun with another SFT learning rate, asking to resume (generate_data in lower case).
    # The data is kept (same settings), then SFT refuses in one line naming the key; nothing is mixed.
    weights = next(dirs["CHECKPOINT_DIR"].glob("global_step_*/model.safetensors")).read_bytes()
    env |= {"RESUME": "1", "SFT_OVERRIDES": env["SFT_OVERRIDES"].replace("optim.lr=1e-3", "optim.lr=1e-5")}
    result = _run("run_spa.sh", "_3_frozen_lake", "last", "true", "trainer.test_freq=0", env=env)
    assert result.returncode == 2 and "already holds this dataset" in result.stdout
    assert "optim.lr (0.001 -> 1e-05)" in result.stderr and "Traceback" not in result.stderr
    assert next(dirs["CHECKPOINT_DIR"].glob("global_step_*/model.safetensors")).read_bytes() == weights


@pytest.mark.slow
def test_run_baseline_trains_from_the_base_model(tmp_path):
    """The default baseline is the paper's Vanilla RL: the plain symbol grid, no coordinates."""
    result = _run("run_baseline.sh", "_10_sudoku", "trainer.test_freq=0",
                  env={"BASE_DIR": str(tmp_path), "TOTAL_STEPS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    run_dir = tmp_path / "_10_sudoku" / "_10_sudoku-tiny-text-vanilla_rl"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 1 and "train/Sudoku/success" in records[-1]
    config = (run_dir / "config.yaml").read_text()
    assert "render_mode: text\n" in config and "name: vanilla_rl" in config


@pytest.mark.parametrize("script, args, env, message", [
    ("run_spa.sh", (), {}, "usage: bash run_spa.sh"),
    ("run_spa.sh", ("_5_webshop",), {}, "unknown config '_5_webshop'"),
    ("run_spa.sh", ("_2_sokoban",), {"CHECKPOINT_DIR": "/nonexistent/sft"}, "does not exist"),
    ("run_spa.sh", ("_2_sokoban",), {"MODEL": "7B"}, "unknown MODEL '7B'"),
    ("train_ppo_sfted.sh", ("_2_sokoban", str(REPO / "config"), "x"), {}, "is not a Hugging Face model directory"),
    ("run_baseline.sh", (), {}, "usage: bash run_baseline.sh"),
    ("run_baseline.sh", ("_2_sokoban", "experiment=spa"), {}, "experiment spa runs with run_spa.sh"),
    ("run_spa.sh", ("_2_sokoban", "last", "False", "experiment=easy_to_hard"), {}, "applies to _3_frozen_lake"),
    ("run_spa.sh", ("_2_sokoban", "last", "maybe"), {}, "generate_data must be True or False, got 'maybe'"),
    ("train_ppo_sfted.sh", ("_2_sokoban", "tiny", "x"), {"RESUME": "yes"}, "RESUME must be 0"),
])
def test_scripts_report_user_errors_in_one_line(script, args, env, message):
    result = _run(script, *args, env=env, timeout=120)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_latest_checkpoint_picks_the_highest_global_step(tmp_path):
    for name in ("global_step_9", "global_step_10", "global_step_2", "not_a_step", "global_step_x"):
        (tmp_path / name).mkdir()
    result = subprocess.run(["bash", "-c", f". {REPO / 'scripts/common.sh'}; latest_checkpoint {tmp_path}"],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(tmp_path / "global_step_10")

"""benchmarks/backend_curves.py: which metrics it draws and the table it prints for the bandit and for Sokoban."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "backend_curves.py"


def load_script():
    spec = importlib.util.spec_from_file_location("backend_curves", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sokoban_run(success_at_0: float, success_at_5: float) -> list[dict]:
    return [{"step": 0, "val-env/SimpleSokoban/success": success_at_0}] + [
        {"step": s, "critic/score/mean": -0.5 + s, "actor/entropy": 0.3, "actor/ppo_kl": 0.001 * s,
         "train/diag/format_valid": 0.1 * s, **({"val-env/SimpleSokoban/success": success_at_5} if s == 5 else {})}
        for s in range(1, 6)]


def test_panels_follow_the_environment_and_the_logged_metrics():
    curves = load_script()
    bandit = {"local_seed0": [{"step": 0, "val-env/Bandit/success": 0.5},
                              {"step": 1, "critic/score/mean": 0.4, "actor/entropy": 0.1, "actor/ppo_kl": 0.01}]}
    assert [key for key, _ in curves.panels(bandit)] == [
        "val-env/Bandit/success", "critic/score/mean", "actor/entropy", "actor/ppo_kl"]
    sokoban = {"local_seed0": sokoban_run(0.0, 0.25), "verl_seed0": sokoban_run(0.0, 0.5)}
    assert [key for key, _ in curves.panels(sokoban)][0] == "val-env/SimpleSokoban/success"
    assert curves.panels(sokoban)[-1] == ("train/diag/format_valid", "well-formed training turns")
    one_minibatch = {name: [{**r, "actor/ppo_kl": 0.0} for r in run] for name, run in sokoban.items()}
    assert "actor/ppo_kl" not in dict(curves.panels(one_minibatch))  # 0 at every step: nothing to draw
    with pytest.raises(ValueError, match="found none"):
        curves.panels({"local_seed0": [{"step": 1, "actor/entropy": 0.1}]})
    with pytest.raises(ValueError, match="one environment"):
        curves.panels({**sokoban, **bandit})


def test_table_gives_wilson_intervals_for_validation_only(tmp_path):
    for name, run in {"local_seed0": sokoban_run(0.0, 0.25), "verl_seed0": sokoban_run(0.0, 0.5)}.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run))
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--out", str(tmp_path / "c.png"),
                             "--val-episodes", "256"], capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    # 0.25 of 256 episodes: Wilson [0.20, 0.31]; 0.5: [0.44, 0.56]
    assert "| local_seed0 | 0.00 [0.00, 0.01] | 0.25 [0.20, 0.31] |" in lines
    assert "| verl_seed0 | 0.00 [0.00, 0.01] | 0.50 [0.44, 0.56] |" in lines
    assert "| verl_seed0 | 0.100 | 0.200 | 0.300 | 0.400 | 0.500 |" in lines  # format_valid, no interval
    assert (tmp_path / "c.png").stat().st_size > 0


def test_missing_runs_and_mixed_environments_are_one_line_errors(tmp_path):
    command = [sys.executable, str(SCRIPT), str(tmp_path), "--out", str(tmp_path / "c.png")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2 and "no <backend>_seed<s>.jsonl files" in result.stderr
    (tmp_path / "local_seed0.jsonl").write_text(json.dumps({"step": 0, "val-env/Bandit/success": 1.0}) + "\n")
    (tmp_path / "verl_seed0.jsonl").write_text(json.dumps({"step": 0, "val-env/SimpleSokoban/success": 1.0}) + "\n")
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "expected the validation success of one environment" in result.stderr

"""Report rows carry the run's named experiment and the paper row it corresponds to, with the paper's numbers
for the run's model and env where the paper reports them."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from SPA_agent.evaluation.report import build_report
from SPA_agent.experiments import EXPERIMENT_DIR


def _eval_dir(root, name: str, experiment: str | None, model_size: str, tag: str):
    config = {"model_size": model_size}
    if experiment:
        config["experiment_info"] = OmegaConf.to_container(
            OmegaConf.load(EXPERIMENT_DIR / f"{experiment}.yaml").experiment_info)
    run = root / name
    run.mkdir()
    metrics = {tag: {"success": 0.25, "pass_any@2": 0.5, "num_puzzles": 4}}
    (run / "eval.json").write_text(json.dumps({"n": 2, "complete": True, "metrics": metrics, "model_name": "m",
                                               "config": config}))
    return run


@pytest.mark.parametrize("experiment, model_size, tag, cells", [
    ("vanilla_rl", "1.5B", "SimpleSokoban", "| vanilla_rl | Table 2/7: Vanilla RL (PPO): P@1 25.6 / P@8 34.0 |"),
    ("state_estimation_rl", "0.5B", "Sudoku", "| state_estimation_rl | Table 2/7: State Estimation RL: P@1 4.5 / P@8 14.1 |"),
    ("self_belief_sft", "1.5B", "SimpleSokoban", "| self_belief_sft | Table 3: SPA with self-belief SFT: P@1 39.2 / P@8 44.2 |"),
    ("self_belief_sft", "1.5B", "FrozenLake", "| self_belief_sft | Table 3: SPA with self-belief SFT: — |"),
    ("easy_to_hard", "3B", "FrozenLake6x6", "| easy_to_hard | Fig. 9: Easy2Hard SPA (FrozenLake 4x4 -> 6x6): P@1 32.6 / P@8 35.9 |"),
    ("random_coordinates", "1.5B", "SimpleSokoban", "| random_coordinates | §4.2 Fig. 5: random coordinates: figure only |"),
    (None, "1.5B", "SimpleSokoban", "| complete | — | — |"),
])
def test_rows_are_labelled_with_experiment_and_paper_row(tmp_path, experiment, model_size, tag, cells):
    report = build_report([_eval_dir(tmp_path, "run", experiment, model_size, tag)])
    (row,) = [line for line in report.splitlines() if line.startswith(f"| run | {tag} |")]
    assert row.endswith(cells)

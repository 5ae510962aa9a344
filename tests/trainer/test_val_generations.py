"""`trainer.log_val_generations`: validation trajectories as text in val_generations.jsonl, one of each of the first
N puzzles at every validation, the same puzzles each time, cut back with the metrics when a run resumes."""

from __future__ import annotations

import json

import pytest

from SPA_agent.rollout.turns import EnvRecord
from SPA_agent.runs.generations_log import (
    GENERATIONS_FILE,
    GenerationsLog,
    first_of_each_group,
    trajectory_record,
)
from SPA_agent.trainer.config_checks import check_config
from SPA_agent.trainer.main_ppo import run

#: three validation puzzles, two of them logged, a validation every step
LOGGED = ("es_manager.val.env_groups=3", "es_manager.val.env_configs.n_groups=[3]", "trainer.test_freq=1",
          "trainer.save_freq=2", "trainer.log_val_generations=2")


def record(env_id: int, group_id: int, answer: str = "Up") -> EnvRecord:
    turn = {"state": "#P_#", "actions_left": 5, "actions": [answer], "reward": -0.1, "info": {"success": False},
            "llm_response": f"<answer>{answer}</answer>", "llm_raw_response": f"<think>go</think><answer>{answer}</answer>",
            "parsed": {"format_ok": True}, "response_ids": [1, 2]}
    return EnvRecord(env_id, group_id, "SimpleSokoban", 100 + group_id, 0.0, {"SimpleSokoban/success": 0.0},
                     [turn, {"state": "#_P#", "actions_left": 4}])


def test_a_trajectory_is_its_shown_states_raw_responses_actions_and_rewards():
    assert trajectory_record(25, record(3, 1)) == {
        "step": 25, "group_id": 1, "env_id": 3, "seed": 101, "tag": "SimpleSokoban",
        "metrics": {"SimpleSokoban/success": 0.0}, "penalty": 0.0,
        "turns": [{"state": "#P_#", "response": "<think>go</think><answer>Up</answer>", "actions": ["Up"],
                   "reward": -0.1, "format_ok": True}],
        "final_state": "#_P#",
    }


def test_the_first_trajectory_of_each_of_the_first_groups():
    states = [record(5, 2), record(1, 0), record(4, 2), record(0, 0), record(3, 1), record(2, 1)]
    assert [(r.env_id, r.group_id) for r in first_of_each_group(states, 2)] == [(0, 0), (2, 1)]
    assert [r.env_id for r in first_of_each_group(states, 10)] == [0, 2, 4]


def test_the_log_appends_each_validation_and_cuts_back_to_a_resumed_step(tmp_path):
    log = GenerationsLog(tmp_path, 1)
    for step in (0, 1, 2):
        log.log(step, [record(0, 0), record(1, 1)])
    with (tmp_path / GENERATIONS_FILE).open("a") as f:
        f.write('{"step": 3, "gro')  # a run killed while writing
    log.truncate_after(1)
    lines = [json.loads(line) for line in (tmp_path / GENERATIONS_FILE).read_text().splitlines()]
    assert [(r["step"], r["group_id"]) for r in lines] == [(0, 0), (1, 0)]
    GenerationsLog(tmp_path / "off", 0).log(0, [record(0, 0)])
    assert not (tmp_path / "off").exists()


def test_a_run_writes_one_trajectory_of_each_of_the_first_puzzles_at_every_validation(ppo_config, tmp_path):
    """Three validation puzzles, two asked for; validations at steps 0, 1 and 2; then the run continues to step 3
    from its step-2 checkpoint: a step-3 line written before (a crash after an unsaved validation) is dropped, and
    step 3's lines are written once."""
    out = run(ppo_config("_2_sokoban", *LOGGED, "trainer.total_training_steps=2"))
    lines = [json.loads(line) for line in (out / GENERATIONS_FILE).read_text().splitlines()]
    assert [(r["step"], r["group_id"]) for r in lines] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert len({(r["group_id"], r["seed"]) for r in lines}) == 2  # the same two puzzles at every validation
    for line in lines:
        assert 1 <= len(line["turns"]) <= 2 and line["final_state"]
        assert all(isinstance(turn["response"], str) and turn["state"] for turn in line["turns"])
        assert "SimpleSokoban/success" in line["metrics"]
    with (out / GENERATIONS_FILE).open("a") as f:  # as if step 3 had validated before a crash, unsaved
        f.write(json.dumps({**lines[-1], "step": 3, "group_id": 7}) + "\n")
    run(ppo_config("_2_sokoban", *LOGGED, "trainer.total_training_steps=3"))
    lines = [json.loads(line) for line in (out / GENERATIONS_FILE).read_text().splitlines()]
    assert [(r["step"], r["group_id"]) for r in lines][4:] == [(2, 0), (2, 1), (3, 0), (3, 1)]


@pytest.mark.parametrize("value", ["-1", "two"])
def test_the_count_is_a_whole_number_from_0(ppo_config, value):
    with pytest.raises(ValueError, match=r"trainer\.log_val_generations"):
        check_config(ppo_config("_2_sokoban", f"trainer.log_val_generations={value}"))

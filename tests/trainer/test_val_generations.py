"""`trainer.log_val_generations`: validation trajectories as text in val_generations.jsonl (the evaluation's
trajectories.jsonl records with the step), one of each of the first N puzzles at every validation, the same puzzles
each time, cut back with the metrics when a run resumes."""

from __future__ import annotations

import json

import pytest

from SPA_agent.evaluation.evaluate import trajectory_record
from SPA_agent.rollout.turns import EnvRecord
from SPA_agent.trainer.config_checks import check_config
from SPA_agent.trainer.generations_log import GENERATIONS_FILE, GenerationsLog, first_of_each_group
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


class ChatOf:
    """The one thing of the agent proxy the log reads: a finished trajectory's chat (`messages`)."""

    def messages(self, state: EnvRecord, normalized: bool = True) -> list[dict]:
        return [{"role": "user", "content": state.history[0]["state"]},
                {"role": "assistant", "content": state.history[0]["llm_raw_response"]}]


def test_a_line_is_the_evaluations_trajectory_record_with_the_step(tmp_path):
    """What trajectories.jsonl of an evaluation holds for the trajectory, the step first; one of each group."""
    out = tmp_path
    GenerationsLog(out, 1).log(25, ChatOf(), [record(3, 1), record(1, 0, "Down")])
    line = json.loads((out / GENERATIONS_FILE).read_text())
    assert line == {"step": 25, **trajectory_record(ChatOf(), record(1, 0, "Down"), repeat=0, failed=False)}
    assert line["messages"][1]["content"] == "<think>go</think><answer>Down</answer>"  # the raw response
    assert (line["actions"], line["rewards"], line["true_states"]) == ([["Down"]], [-0.1], ["#P_#", "#_P#"])
    assert list(line)[0] == "step" and line["seed"] == 100 and line["success"] is False


def test_the_first_trajectory_of_each_of_the_first_groups():
    states = [record(5, 2), record(1, 0), record(4, 2), record(0, 0), record(3, 1), record(2, 1)]
    assert [(r.env_id, r.group_id) for r in first_of_each_group(states, 2)] == [(0, 0), (2, 1)]
    assert [r.env_id for r in first_of_each_group(states, 10)] == [0, 2, 4]


def test_the_log_appends_each_validation_and_cuts_back_to_a_resumed_step(tmp_path):
    log = GenerationsLog(tmp_path, 1)
    for step in (0, 1, 2):
        log.log(step, ChatOf(), [record(0, 0), record(1, 1)])
    with (tmp_path / GENERATIONS_FILE).open("a") as f:
        f.write('{"step": 3, "gro')  # a run killed while writing
    log.truncate_after(1)
    lines = [json.loads(line) for line in (tmp_path / GENERATIONS_FILE).read_text().splitlines()]
    assert [(r["step"], r["group_id"]) for r in lines] == [(0, 0), (1, 0)]
    GenerationsLog(tmp_path / "off", 0).log(0, ChatOf(), [record(0, 0)])
    assert not (tmp_path / "off").exists()


def test_a_run_writes_one_trajectory_of_each_of_the_first_puzzles_at_every_validation(ppo_config, tmp_path):
    """Three validation puzzles, two asked for; validations at steps 0, 1 and 2; then the run continues to step 3
    from its step-2 checkpoint: a step-3 line written before (a crash after an unsaved validation) is dropped, and
    step 3's lines are written once."""
    out = run(ppo_config("_2_sokoban", *LOGGED, "trainer.total_training_steps=2"))
    lines = [json.loads(line) for line in (out / GENERATIONS_FILE).read_text().splitlines()]
    assert [(r["step"], r["group_id"]) for r in lines] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert len({(r["group_id"], r["seed"]) for r in lines}) == 2  # the same two puzzles at every validation
    for line in lines:  # the evaluation's record: one action list, reward and assistant message a turn
        turns = len(line["actions"])
        assert 1 <= turns <= 2 and len(line["rewards"]) == turns and len(line["true_states"]) == turns + 1
        assert [m["role"] for m in line["messages"]].count("assistant") == turns
        assert (line["repeat"], line["failed_request"]) == (0, False)
        assert line["success"] == (line["metrics"]["SimpleSokoban/success"] > 0)
    with (out / GENERATIONS_FILE).open("a") as f:  # as if step 3 had validated before a crash, unsaved
        f.write(json.dumps({**lines[-1], "step": 3, "group_id": 7}) + "\n")
    run(ppo_config("_2_sokoban", *LOGGED, "trainer.total_training_steps=3"))
    lines = [json.loads(line) for line in (out / GENERATIONS_FILE).read_text().splitlines()]
    assert [(r["step"], r["group_id"]) for r in lines][4:] == [(2, 0), (2, 1), (3, 0), (3, 1)]


@pytest.mark.parametrize("value", ["-1", "two"])
def test_the_count_is_a_whole_number_from_0(ppo_config, value):
    with pytest.raises(ValueError, match=r"trainer\.log_val_generations"):
        check_config(ppo_config("_2_sokoban", f"trainer.log_val_generations={value}"))

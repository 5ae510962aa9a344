"""benchmarks/generations_summary.py: what a run's val_generations.jsonl says its policy wrote, step by step."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from SPA_agent.rollout.parsing import parse_response

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "generations_summary.py"


def record(step: int | None, success: bool, *responses: str) -> dict:
    messages = [{"role": "system", "content": "s"}]
    for response in responses:
        messages += [{"role": "user", "content": "state"}, {"role": "assistant", "content": response}]
    line = {"repeat": 0, "env_id": 0, "group_id": 0, "tag": "SimpleSokoban", "seed": 1, "success": success,
            "messages": messages}
    return line if step is None else {"step": step, **line}


PLACEHOLDER = "<think> [Your thoughts] </think><answer>Left || Up</answer>"
SENTENCE = "<think>I will push   the box.</think> <answer>Down</answer>"
OUTSIDE = "<think> [Your thoughts] </think> I will push the box. <answer>Down</answer>"  # text between the blocks
WORLDMODEL = ("<think> <observation>##P#</observation> push <prediction>#P##</prediction> </think> "
              "<answer>Left</answer>")


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_each_step_counts_well_formed_turns_and_the_most_common_thinks(tmp_path):
    lines = [record(0, False, OUTSIDE, OUTSIDE), record(0, True, SENTENCE),
             record(25, True, PLACEHOLDER, PLACEHOLDER, SENTENCE), record(25, False, PLACEHOLDER)]
    (tmp_path / "val_generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5')
    done = run(tmp_path, "--top", "2")
    assert done.returncode == 0, done.stderr
    chars0 = (2 * len(OUTSIDE) + len(SENTENCE)) / 3
    chars25 = (3 * len(PLACEHOLDER) + len(SENTENCE)) / 4
    assert done.stdout.splitlines()[2:] == [
        f"| 0 | 2 | 0.500 | 3 | 0.333 | {chars0:.0f} | `(malformed: text between </think> and <answer>)` 2; "
        "`I will push the box.` 1 |",
        f"| 25 | 2 | 0.500 | 4 | 1.000 | {chars25:.0f} | `[Your thoughts]` 3; `I will push the box.` 1 |"]


def test_the_runs_config_gives_the_prompt_mode_and_mode_overrides_it(tmp_path):
    (tmp_path / "val_generations.jsonl.gz").write_bytes(gzip.compress(
        (json.dumps(record(50, True, WORLDMODEL, PLACEHOLDER)) + "\n").encode()))
    (tmp_path / "config.yaml").write_text("ctx_manager:\n  mode: add_worldmodel\nagent_proxy:\n  action_sep: '||'\n")
    chars = round((len(WORLDMODEL) + len(PLACEHOLDER)) / 2)
    worldmodel = run(tmp_path)
    assert worldmodel.returncode == 0, worldmodel.stderr
    assert worldmodel.stdout.splitlines()[2].endswith(
        f"| 0.500 | {chars} | `push` 1; `(malformed: no <observation> opening the think)` 1 |")
    base = run(tmp_path / "val_generations.jsonl.gz", "--mode", "base")  # the state blocks inside a base think,
    assert base.stdout.splitlines()[2].endswith(  # their tags stripped as the parser strips them (spec §6.4)
        f"| 1.000 | {chars} | `##P# push #P##` 1; `[Your thoughts]` 1 |")


@pytest.mark.parametrize("mode, response, because", [
    ("base", "I will push the box. <answer>Down</answer>", "no <think>"),
    ("base", "<think> [your answer] </answer> I will push the box.", "no </think>"),
    ("base", "<think>push</think> Down", "no <answer> after </think>"),
    ("base", "<think>push</think> I will push the box. <answer>Down</answer>", "text between </think> and <answer>"),
    ("base", "<think>push</think><answer>Down || Up", "no </answer>"),
    ("add_worldmodel", "<think>push</think><answer>Down</answer>", "no <observation> opening the think"),
    ("add_worldmodel", "<think><observation>##P#", "no </observation>"),
    ("add_worldmodel", "<think><observation>##P#</observation> push </think><answer>Down</answer>", "no <prediction>"),
    ("add_worldmodel", "<think><observation>a</observation> push <prediction>b</prediction> Down", "no "
     "</prediction></think><answer>"),
    ("add_worldmodel", "<think><observation>a</observation><prediction>b</prediction></think><answer>Up",
     "no </answer>"),
])
def test_a_malformed_turn_says_where_it_leaves_the_format(tmp_path, mode, response, because):
    """Each separator of the format the parser looks for, missing in turn (the parser agrees that it is malformed)."""
    assert not parse_response(response, mode=mode).format_ok
    (tmp_path / "val_generations.jsonl").write_text(json.dumps(record(0, False, response)) + "\n")
    done = run(tmp_path, "--mode", mode)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[2].endswith(f"| `(malformed: {because})` 1 |")


def test_without_thinking_a_malformed_turn_lacks_an_answer_block(tmp_path):
    (tmp_path / "val_generations.jsonl").write_text("".join(
        json.dumps(record(0, False, response)) + "\n" for response in ("Down", "<answer>Down", "<answer>Down")))
    (tmp_path / "config.yaml").write_text("agent_proxy:\n  enable_think: false\n")
    assert run(tmp_path).stdout.splitlines()[2].endswith(
        "| `(malformed: no </answer>)` 2; `(malformed: no <answer>)` 1 |")


def test_an_evaluations_trajectories_are_one_line_and_bad_paths_one_line_errors(tmp_path):
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(record(None, False, SENTENCE)) + "\n")
    done = run(tmp_path / "trajectories.jsonl")
    assert done.returncode == 0 and done.stdout.splitlines()[2].startswith("| - | 1 | 0.000 | 1 | 1.000 |")
    long = "<think>" + "step by step " * 10 + "</think><answer>Up</answer>"  # a think cut at 60 characters
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(record(None, False, long)) + "\n")
    assert run(tmp_path / "trajectories.jsonl").stdout.splitlines()[2].endswith(
        f"| `{('step by step ' * 5)[:60]}…` 1 |")
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = run(empty)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"error: {empty}: no val_generations.jsonl or val_generations.jsonl.gz"
    (empty / "val_generations.jsonl").write_text("")
    assert run(empty).stderr.strip() == f"error: {empty / 'val_generations.jsonl'}: no records"

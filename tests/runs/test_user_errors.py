"""Mistakes around output directories and endpoints: one line and a non-zero exit, or the right thing."""

from __future__ import annotations

import json
import socket

import pyarrow.parquet as pq
import pytest

from sft.filter_sft_by_tag import main as filter_main
from SPA_agent.config import compose
from SPA_agent.evaluation.evaluate import evaluate, prepare_eval_config
from SPA_agent.generators.api import APIGenerator
from SPA_agent.report import main as report_main
from SPA_agent.runs.dir_lock import UnwritableDirectoryError
from SPA_agent.runs.progress import progress_bar
from SPA_agent.selfplay.data_card import CARD_FILE, check_dataset_complete

SMALL = ["model=tiny", "++evaluation.n=2", "++evaluation.k=[1,2]", "++evaluation.num_puzzles=2",
         "agent_proxy.max_turn=3", "actor_rollout_ref.rollout.response_length=8", "++evaluation.repeats=2"]
GOOD = "<think> <observation>S0</observation> push <prediction>S1</prediction></think><answer>Up</answer>"


def eval_config(out_dir, *overrides):
    return prepare_eval_config(compose("_2_sokoban", [*SMALL, *overrides, f"++evaluation.output_dir={out_dir}"]),
                               "_2_sokoban")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_endpoint_stops_after_one_turn_naming_the_cause(tmp_path, monkeypatch):
    calls = []
    real_generate = APIGenerator.generate

    def counting_generate(self, prompts, allow_failures=False):
        calls.append(len(prompts))
        return real_generate(self, prompts, allow_failures)

    monkeypatch.setattr(APIGenerator, "generate", counting_generate)
    cfg = eval_config(tmp_path / "eval", "generator=api", f"generator.base_url=http://127.0.0.1:{closed_port()}/v1",
                      "generator.api_key_env=null", "generator.max_retries=1", "++generator.backoff_s=0.01")
    result = evaluate(cfg)
    assert calls == [4]  # the first turn of 2 puzzles × 2 samples; no retries of later turns or repeats
    on_disk = json.loads((tmp_path / "eval" / "eval.json").read_text())
    for record in (result, on_disk):
        assert record["complete"] is False
        assert "every request of a turn failed" in record["error"] and "cannot be reached" in record["error"]


def test_unwritable_eval_directory_fails_before_any_rollout(tmp_path):
    class MustNotRun:
        def generate(self, prompts):
            raise AssertionError("generation started")

    (tmp_path / "a_file").write_text("")
    cfg = eval_config(tmp_path / "a_file" / "eval", "generator=random")
    with pytest.raises(UnwritableDirectoryError, match="cannot write to"):
        evaluate(cfg, generator=MustNotRun())


def test_report_to_an_unwritable_file_is_one_line(tmp_path, capsys):
    run = tmp_path / "ppo"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "val-env/SimpleSokoban/success": 0.5}\n')
    (tmp_path / "a_file").write_text("")
    assert report_main([str(run), "--out", str(tmp_path / "a_file" / "r.md")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write") and err.count("\n") == 1


def _write_split(directory, responses):
    import pyarrow as pa

    directory.mkdir(parents=True, exist_ok=True)
    prompt = [{"content": "s", "role": "system"}]
    for split in ("wm_train", "wm_val"):
        pq.write_table(pa.table({"prompt": [prompt] * len(responses), "response": responses}),
                       directory / f"{split}.parquet")


def test_filter_refuses_impossible_bounds_and_writes_a_card(tmp_path, capsys):
    source = tmp_path / "in"
    _write_split(source, [GOOD, GOOD + " ", None])
    assert filter_main(["--input", str(source), "--output", str(tmp_path / "out"), "--min-len", "500",
                        "--max-len", "10"]) == 2
    assert "--min-len 500 is greater than --max-len 10" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert filter_main(["--input", str(source), "--output", str(tmp_path / "out")]) == 0
    card = json.loads((tmp_path / "out" / CARD_FILE).read_text())
    assert card["splits"]["wm_train"]["kept"] == 2 and card["source_card"] is None
    check_dataset_complete(tmp_path / "out" / "wm_train.parquet")


def test_progress_bars_write_plain_lines_to_a_log_file(tmp_path):
    log = tmp_path / "run.log"
    with log.open("w") as f:
        assert list(progress_bar(range(2), desc="steps", file=f)) == [0, 1]
        assert list(progress_bar(range(2, 3), desc="batches", initial=2, total=3, file=f)) == [2]
        assert list(progress_bar(range(2), desc="quiet", file=f, disable=True)) == [0, 1]
        assert list(progress_bar(range(2), desc="own lines", file=f, lines=False)) == [0, 1]
    assert log.read_text() == "steps 1/2 done (0 s)\nsteps 2/2 done (0 s)\nbatches 3/3 done (0 s)\n"

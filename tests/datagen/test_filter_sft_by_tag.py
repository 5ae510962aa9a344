"""sft/filter_sft_by_tag.py: format cases, length bounds, dedup on array prompts, the released §8 schema."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sft.filter_sft_by_tag import filter_dir, filter_table, main
from SPA_agent.selfplay.worldmodel import has_worldmodel_format

GOOD = "<think> <observation>S0</observation> push <prediction>S1</prediction></think><answer>Up</answer>"


@pytest.mark.parametrize(
    "response, kept",
    [
        (GOOD, True),
        (GOOD.upper(), True),  # tags are case-insensitive
        ("<think><observation>a</observation><prediction>b</prediction></think> <answer>Up || Down</answer>", True),
        ("<think> no states </think><answer>Up</answer>", False),
        ("<think><prediction>b</prediction><observation>a</observation></think><answer>Up</answer>", False),
        ("<think><observation>a</observation></think><answer>Up</answer>", False),
        ("<answer>Up</answer><think><observation>a</observation><prediction>b</prediction></think>", False),
        ("<think><observation>a</observation><prediction>b</prediction></think>", False),  # no answer
        ("<think><observation>a</observation></think><prediction>b</prediction><answer>Up</answer>", False),
        ("", False),
    ],
)
def test_format_cases(response, kept):
    assert has_worldmodel_format(response) is kept


def released_frame(responses: list[str]) -> pd.DataFrame:
    """Rows with exactly the released §8 schema: prompt as a numpy object array of {role, content} dicts."""
    prompt = np.array([{"content": "You're a helpful assistant. ", "role": "system"},
                       {"content": "Turn 1:\nState:\n#P#", "role": "user"}], dtype=object)
    return pd.DataFrame({
        "data_source": ["sokoban"] * len(responses),
        "prompt": [prompt] * len(responses),
        "response": responses,
        "ability": ["bfs"] * len(responses),
        "reward_model": ["{'ground_truth': {'numbers': array([0, 0]), 'target': 0}, 'style': 'rule'}"] * len(responses),
        "extra_info": ["{'index': 100016, 'split': 'train'}"] * len(responses),
    })


def test_released_schema_round_trip_with_dedup(tmp_path):
    """Loader compatibility: a file written like the released data (pandas, object-array prompts) is read,
    de-duplicated on its array-valued prompt (which crashed the original) and written with the same schema."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    frame = released_frame([GOOD, GOOD, "<think>x</think><answer>Up</answer>", GOOD + " "])
    for split in ("wm_train", "wm_val"):
        frame.to_parquet(src / f"{split}.parquet", index=False)
    stats = filter_dir(src, out, min_len=None, max_len=None, dedup=True)
    assert (stats["wm_train"].kept, stats["wm_train"].duplicate, stats["wm_train"].bad_format) == (2, 1, 1)
    table = pq.read_table(out / "wm_train.parquet")
    assert table.schema.field("prompt").type.value_type == pa.struct([("content", pa.string()), ("role", pa.string())])
    assert table.column("response").to_pylist() == [GOOD, GOOD + " "]
    assert table.column("prompt").to_pylist()[0][1] == {"content": "Turn 1:\nState:\n#P#", "role": "user"}


def test_no_dedup_and_length_bounds():
    table = pa.Table.from_pandas(released_frame([GOOD, GOOD, GOOD + "x" * 50]), preserve_index=False)
    kept, stats = filter_table(table, dedup=False)
    assert kept.num_rows == 3
    kept, stats = filter_table(table, min_len=len(GOOD) + 1, dedup=False)
    assert kept.num_rows == 1 and stats.bad_length == 2
    kept, stats = filter_table(table, max_len=len(GOOD), dedup=True)
    assert kept.num_rows == 1 and (stats.bad_length, stats.duplicate) == (1, 1)


def test_cli_help_and_bad_input(tmp_path, capsys):
    result = subprocess.run([sys.executable, "sft/filter_sft_by_tag.py", "--help"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "--no-dedup" in result.stdout
    assert main(["--input", str(tmp_path / "nope"), "--output", str(tmp_path / "out")]) == 2
    assert "wm_train" in capsys.readouterr().err

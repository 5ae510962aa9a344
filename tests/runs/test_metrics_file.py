"""SPA_agent/runs/metrics_file.py: a metrics.jsonl read back, plain or gzip-compressed, with a cut-short last line."""

from __future__ import annotations

import gzip

import pytest

from SPA_agent.runs.metrics_file import read_records

LINES = '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n'


@pytest.mark.parametrize("name", ["metrics.jsonl", "metrics.jsonl.gz"])
def test_the_records_in_order_and_a_cut_short_last_line_dropped(tmp_path, name):
    path = tmp_path / name
    for text, intact in ((LINES, True), (LINES + '{"step": 3, "lo', False)):
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
        assert read_records(path) == ([{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}], intact)


def test_a_missing_file_is_empty_and_a_bad_line_before_the_last_is_named(tmp_path):
    assert read_records(tmp_path / "absent.jsonl") == ([], True)
    path = tmp_path / "metrics.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"step": 1}\nnot json\n{"step": 3}\n'))
    with pytest.raises(ValueError, match=r"metrics.jsonl.gz:2 is not a JSON line"):
        read_records(path)

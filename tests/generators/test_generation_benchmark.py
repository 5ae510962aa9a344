"""benchmarks/generation.py at CI size, so the script cannot rot."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "generation.py"


@pytest.mark.slow
def test_smoke_run_prints_measurements_and_agreeing_greedy_checks(monkeypatch, capsys):
    # `python benchmarks/generation.py --smoke` run in this process: torch and transformers are imported already,
    # which a new interpreter spent most of this test's seconds on
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--smoke"])
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the script's own folder, as `python <script>` puts first
    runpy.run_path(str(SCRIPT), run_name="__main__")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    checks = [line for line in lines if line["metric"] == "greedy_check"]
    assert checks and all(
        c["sequences_identical"] == 1.0 and c["static"]["teacher_forced_agreement"] == 1.0 for c in checks
    )
    rates = {line["decoder"]: line["new_tokens_per_s"] for line in lines if line["metric"] == "generation"}
    assert set(rates) == {"generate", "static"} and min(rates.values()) > 0

"""benchmarks/generation.py at CI size, so the script cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_run_prints_measurements_and_agreeing_greedy_checks():
    result = subprocess.run(
        [sys.executable, "benchmarks/generation.py", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    checks = [line for line in lines if line["metric"] == "greedy_check"]
    assert checks and all(
        c["sequences_identical"] == 1.0 and c["static"]["teacher_forced_agreement"] == 1.0 for c in checks
    )
    rates = {line["decoder"]: line["new_tokens_per_s"] for line in lines if line["metric"] == "generation"}
    assert set(rates) == {"generate", "static"} and min(rates.values()) > 0

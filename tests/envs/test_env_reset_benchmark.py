"""benchmarks/env_reset.py at CI size, so the script cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_times_both_envs_and_agrees_with_the_reference():
    result = subprocess.run(
        [sys.executable, "benchmarks/env_reset.py", "--seeds", "3", "--repeats", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    timed = {(line["env"], line["impl"]) for line in lines if line["metric"] == "room_generation_ms_per_room"}
    assert {("SimpleSokoban", "ours"), ("SimpleSokoban", "reference"), ("HarderSokoban", "ours")} <= timed
    checks = [line for line in lines if line["metric"] == "room_generation_speedup"]
    against_reference = [line for line in checks if line["reference"] == "reference"]
    assert len(against_reference) == 2 and all(line["identical_rooms"] for line in against_reference)
    assert all(line["ratio"] > 0 for line in checks)

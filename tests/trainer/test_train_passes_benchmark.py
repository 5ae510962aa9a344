"""benchmarks/train_passes.py at CI size on both backends, so the script cannot rot.

The verl backend's workers (actor and critic) run in a child process on the CPU as in test_verl_engine_packed:
one gloo rank, verl_cpu's platform, FSDP2 in float32 in place of the configured FSDP1 in bf16 (FSDP1 refuses to
run without an accelerator); the timed passes are VerlBackend's, through verl's workers. No reference model on
either backend: verl offloads the reference's weights to pinned CPU memory, which needs an accelerator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from verl_cpu import CPU_SETTINGS

from SPA_agent.tiny import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
PASSES = ["old_log_prob", "values", "update_critic", "update_actor", "total"]
SMALL = ["--preset", "tiny", "--repeats", "2", "--trajectories", "4", "--tokens", "40",
         "--set", "actor_rollout_ref.actor.use_ref=False"]


def _command(out: Path, *args) -> dict:
    """One run of the benchmark, a child process that runs beside the other tests (tests/conftest.py, `background`)."""
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return {"args": [sys.executable, *args, "--model", str(tiny_model_dir()), *SMALL, "--out", str(out)], "cwd": ROOT,
            "env": env, "timeout": 300}


def _lines(result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _both_backends(directory: Path) -> list[dict]:
    out = directory / "passes.jsonl"
    return [_command(out, "benchmarks/train_passes.py", "--backend", "local", "--label", "local"),
            _command(out, __file__, "--backend", "verl", "--label", "verl",
                     "--set", "verl_backend.rollout_name=sglang", *sum((["--set", e] for e in CPU_SETTINGS), []))]


@pytest.mark.slow
@pytest.mark.background(command=_both_backends)
def test_both_backends_time_every_pass(background_run):
    results, directory = background_run
    out = directory / "passes.jsonl"
    local, verl = (_lines(result) for result in results)
    for lines, label in ((local, "local"), (verl, "verl")):
        assert [line["repeat"] for line in lines] == [0, 1]
        cpu = [f"{name}_thread_cpu" for name in PASSES if name != "total"]
        assert all(list(line)[2:] == PASSES + cpu and line["label"] == label for line in lines)
        assert all(line[name] > 0 for line in lines for name in PASSES + cpu)
    summaries = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["backend"] for s in summaries] == ["local", "verl"]
    assert summaries[0]["tokens"] == summaries[1]["tokens"] > 4 * 36  # the same synthetic batch on both
    assert set(CPU_SETTINGS) <= set(summaries[1]["overrides"])
    for s in summaries:
        assert s["median_s"]["total"] == pytest.approx(s["steps"][1]["total"])


def _ray_actors(directory: Path) -> dict:
    return _command(directory / "passes.jsonl", "benchmarks/train_passes.py", "--backend", "verl", "--label", "ray",
                    "--ray", "1", "--ray-async", "--rank-setup", "verl_cpu:start_cpu_rank",
                    "--set", "verl_backend.rollout_name=sglang", "--set", "verl_backend.worker_niceness=7",
                    *sum((["--set", e] for e in CPU_SETTINGS), []))


@pytest.mark.slow
@pytest.mark.background(command=_ray_actors)
def test_the_verl_ranks_run_as_async_ray_actors(background_run):
    # the same passes in an async Ray actor, as verl's fused worker runs them; the rank builds its CPU group there,
    # in a cluster started with the run's worker niceness (neither ours, 0, nor Ray's, 15)
    (result,), directory = background_run
    out = directory / "passes.jsonl"
    lines = _lines(result)
    assert [line["repeat"] for line in lines] == [0, 1] and all(line["label"] == "ray" for line in lines)
    assert all(line[name] > 0 for line in lines for name in PASSES)
    (summary,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["ranks"] == "ray async actors" and summary["gpus"] == 1 and summary["backend"] == "verl"
    assert summary["niceness"] == 7 and summary["torch_threads"] == 1  # verl_backend.worker_cpu_threads


@pytest.mark.parametrize("args, message", [
    (["--ray-async"], "--ray-async needs --ray N"),
    (["--setup-hook"], "--setup-hook needs --ray N"),
    (["--ray", "0"], "--ray takes a number of ranks"),
    (["--backend", "local", "--ray", "2"], "the local backend runs one process"),
])
def test_bad_ray_options_are_one_line_usage_errors(args, message, monkeypatch, capsys):
    """The script's main() in this process (the tests above start it as a process)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import train_passes

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        train_passes.main(["--model", "unused", "--backend", "verl", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.startswith("usage: ")


if __name__ == "__main__":  # the verl run: this process as a one-rank CPU "GPU" group, then the benchmark
    sys.path[:0] = [str(ROOT / "benchmarks"), str(Path(__file__).parent)]
    from verl_cpu import start_cpu_rank

    start_cpu_rank()
    import train_passes

    train_passes.main(sys.argv[1:])

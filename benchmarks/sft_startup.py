"""SFT start-up: seconds from `bash sft/finetune_ft.sh` starting to its first optimizer step (issue 42).

Runs `bash <repo>/sft/finetune_ft.sh _2_sokoban 1 <fresh dir> <data> <model> trainer.total_training_steps=1 ...`
`--repeats` times for each `--repo` (checkouts of this repository, e.g. before and after a change), interleaved, and
traces every Python process the command starts (a sitecustomize.py on PYTHONPATH, which the script keeps): its
start, when `import torch` ended, the SFT trainer's phases (preflight, setup's data, model, optimizer, ...) and
its exit. Prints one JSON line per run, then one per repo with the medians:

- `to_first_step_s`: the command's start to the first step's start (setup done);
- `step_line_s`: to the log's `step 1/` line (the first step included); `total_s`: to the command's end;
- `processes`: each Python process: `argv` (its first arguments), `start_s`, `torch_s` and `transformers_s` (when
  its import of torch, of transformers' top level, ended; absent: none), `task_s` (the trainer's entry function
  called: imports done, config composed), `exit_s` (its last Python code; the interpreter's teardown follows);
- `phases_s`: the trainer's phases, seconds each, `<pid>:<phase>`.

    python benchmarks/sft_startup.py --data sftdata/_2_sokoban --repo /tmp/before --repo . --repeats 3 \\
        -- data.train_batch_size=2 data.val_files=null

A step of the default 16 rows takes about a minute on the tiny model on CPU (rows of ~2,000 tokens in one packed
micro-batch); `data.train_batch_size=2` keeps the first step short. Measure on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: sitecustomize.py of the traced processes: appends `<time> <pid> <event> <detail>` lines to $SFT_STARTUP_TRACE
TRACER = r'''
import atexit, functools, importlib.abc, importlib.util, os, sys, time

TRACE = os.environ["SFT_STARTUP_TRACE"]


def log(event, detail=""):
    with open(TRACE, "a") as f:
        f.write(f"{time.time():.3f} {os.getpid()} {event} {detail}\n")


log("start", " ".join(sys.orig_argv[1:4]))
atexit.register(log, "exit")
PHASES = ("preflight", "setup", "_build_data", "_check_output_dir", "_init_distributed", "_build_model",
          "_build_optimizer", "_maybe_resume", "train_step")


def trace_trainer(cls):
    for name in PHASES:
        def timed(self, *args, _method=getattr(cls, name), _name=name, **kwargs):
            log("phase_start", _name)
            start = time.time()
            try:
                return _method(self, *args, **kwargs)
            finally:
                log("phase", f"{_name} {time.time() - start:.3f}")
        setattr(cls, name, timed)


def trace_entry(module):
    """The trainer runs as __main__ (python -m): its SftTrainer is traced when Hydra calls the entry function."""
    hydra_entry = module.hydra_entry

    def traced_entry(*args, **kwargs):
        def decorator(task):
            @functools.wraps(task)
            def traced_task(cfg):
                log("task")
                trace_trainer(sys.modules[task.__module__].SftTrainer)
                return task(cfg)
            return hydra_entry(*args, **kwargs)(traced_task)
        return decorator
    module.hydra_entry = traced_entry


AFTER_IMPORT = {"torch": None, "transformers": None, "SPA_agent.entry": trace_entry}


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in AFTER_IMPORT:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def traced_exec(module, _exec=exec_module, _name=name):
            _exec(module)
            log("imported", _name)
            if AFTER_IMPORT[_name]:
                AFTER_IMPORT[_name](module)
        spec.loader.exec_module = traced_exec
        return spec


sys.meta_path.insert(0, Finder())
'''


def parse_trace(path: Path, t0: float) -> tuple[list[dict], dict[str, float], float | None]:
    """(processes, phases, first step's start) from a trace, in seconds since `t0`."""
    processes, phases, first_step = {}, {}, None
    for line in path.read_text().splitlines():
        stamp, pid, event, *detail = line.split(" ", 3)
        t, detail = round(float(stamp) - t0, 2), detail[0] if detail else ""
        if event == "start":
            processes[pid] = {"argv": detail, "start_s": t}
        elif event == "imported" and detail in ("torch", "transformers"):
            processes[pid][f"{detail}_s"] = t
        elif event == "task":
            processes[pid]["task_s"] = t
        elif event == "exit":
            processes[pid]["exit_s"] = t
        elif event == "phase":
            name, seconds = detail.split()
            phases[f"{pid}:{name}"] = phases.get(f"{pid}:{name}", 0.0) + float(seconds)
        elif event == "phase_start" and detail == "train_step" and first_step is None:
            first_step = t
    return list(processes.values()), {k: round(v, 2) for k, v in phases.items()}, first_step


def run_once(repo: Path, data: Path, model: str, overrides: list[str], tracer_dir: Path) -> dict:
    """One traced run of the SFT command of checkout `repo` into a fresh directory (from `repo`: `python -m` puts the
    working directory first on the module path)."""
    work = Path(tempfile.mkdtemp(prefix="sft_startup_"))
    trace = work / "trace.txt"
    env = {**os.environ, "PYTHONPATH": str(tracer_dir), "SFT_STARTUP_TRACE": str(trace), "PYTHON": sys.executable}
    command = ["bash", str(repo / "sft" / "finetune_ft.sh"), "_2_sokoban", "1", str(work / "out"), str(data), model,
               "trainer.total_training_steps=1", *overrides]
    t0 = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=repo)
    step_line, output = None, []
    for line in proc.stdout:
        output.append(line)
        if step_line is None and line.startswith("step 1/"):
            step_line = round(time.time() - t0, 2)
    code = proc.wait()
    total = round(time.time() - t0, 2)
    if code != 0:
        sys.exit(f"{' '.join(command)} exited with status {code}:\n{''.join(output[-30:])}")
    processes, phases, first_step = parse_trace(trace, t0)
    shutil.rmtree(work)
    return {"repo": str(repo), "to_first_step_s": first_step, "step_line_s": step_line, "total_s": total,
            "processes": processes, "phases_s": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="stage 1's output (wm_train.parquet, ...)")
    parser.add_argument("--repo", type=Path, action="append", help="checkout to run (repeatable; default: this one)")
    parser.add_argument("--model", default="tiny", help="<model_size> of finetune_ft.sh")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each repo, interleaved")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after --")
    args = parser.parse_args()
    repos = [repo.resolve() for repo in args.repo or [Path(__file__).resolve().parents[1]]]
    with tempfile.TemporaryDirectory() as tracer_dir:
        (Path(tracer_dir) / "sitecustomize.py").write_text(TRACER)
        runs = []
        for _ in range(args.repeats):
            for repo in repos:
                runs.append(run_once(repo, args.data.resolve(), args.model, args.overrides, Path(tracer_dir)))
                print(json.dumps(runs[-1]), flush=True)
    for repo in repos:
        mine = [run for run in runs if run["repo"] == str(repo)]
        summary = {key: statistics.median(run[key] for run in mine)
                   for key in ("to_first_step_s", "step_line_s", "total_s")}
        print(json.dumps({"repo": str(repo), "runs": len(mine), "median": summary,
                          "all_to_first_step_s": [run["to_first_step_s"] for run in mine]}), flush=True)


if __name__ == "__main__":
    main()

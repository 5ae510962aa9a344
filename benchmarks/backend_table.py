"""The phase table of two PPO runs side by side (benchmarks/backend_speed.sh): steady seconds per phase.

    python benchmarks/backend_table.py <metrics.jsonl> <metrics.jsonl> [--labels A B] [--skip 1]

Steady = the median over the steps after the first --skip (the first step pays CUDA-graph captures, compilation
and allocator warm-up). Rows: the driver's phases (`timing_s/<phase>`, ppo_trainer.py) and the step, without the
checkpoint save or validation that some steps end with; the last column is the second run's time over the first's.
The verl backend's own rows are parts of the driver's: `rollout_wake` (weight sync and engine resume) of `gen`,
`rollout_sleep` (engine release) of `old_log_prob`, and of each training pass `<pass>_prepare` (the driver's layout
of its input) and `<pass>_call` (the worker-group call: dispatch, the workers' work, collection), the rest of the
pass being the driver's layout of its output. Last,
`gc_full`: the driver's full garbage collections within the step, part of whichever phases they fell in.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

#: the driver's phases, each verl training pass followed by its own parts
PHASES = ("gen", "rollout_wake", "filter",
          "old_log_prob", "rollout_sleep", "old_log_prob_prepare", "old_log_prob_call",
          "ref", "ref_prepare", "ref_call", "diagnostics", "values", "values_prepare", "values_call", "adv",
          "update_critic", "update_critic_prepare", "update_critic_call",
          "update_actor", "update_actor_prepare", "update_actor_call")
#: timed parts of a step that are not its training (ppo_trainer.py), left out of the step row
STEP_EXTRAS = ("save_checkpoint", "testing")


def steady(path: Path, skip: int) -> dict[str, float]:
    """Median seconds of each timed phase over the steps after the first `skip`."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if "timing_s/step" in r]
    for r in records:  # the step's training, without the checkpoint save or validation some steps end with
        r["timing_s/step"] -= sum(r.get(f"timing_s/{extra}", 0.0) for extra in STEP_EXTRAS)
    kept = records[skip:] or records[-1:]
    keys = {k for r in kept for k in r if k.startswith("timing_s/")}
    return {k.removeprefix("timing_s/"): statistics.median(r[k] for r in kept if k in r) for k in keys} | {
        "steps": float(len(kept))}


def table(runs: list[dict[str, float]], labels: list[str]) -> str:
    lines = [f"| phase (s) | {' | '.join(labels)} | ratio |", "|---|" + "---|" * (len(labels) + 1)]
    for phase in (*PHASES, "step", "gc_full"):
        if not any(phase in run for run in runs):
            continue
        values = [run.get(phase) for run in runs]
        cells = [f"{v:.2f}" if v is not None else "–" for v in values]
        ratio = f"{values[1] / values[0]:.2f}" if None not in values and values[0] else "–"
        name = f"**{phase}**" if phase == "step" else phase
        lines.append(f"| {name} | {' | '.join(cells)} | {ratio} |")
    lines.append(f"| steps in the median | {' | '.join(str(int(run['steps'])) for run in runs)} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs=2, type=Path, help="two metrics.jsonl files")
    parser.add_argument("--labels", nargs=2, default=["first", "second"])
    parser.add_argument("--skip", type=int, default=1, help="leading steps left out of the median")
    args = parser.parse_args()
    missing = [str(p) for p in args.metrics if not p.is_file()]
    if missing:
        parser.exit(2, f"error: no metrics file: {', '.join(missing)}\n")
    print(table([steady(p, args.skip) for p in args.metrics], args.labels))


if __name__ == "__main__":
    main()

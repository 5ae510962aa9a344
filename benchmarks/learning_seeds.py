"""The one-turn bandit learning test (tests/trainer/test_learning.py) over PPO seeds and torch thread counts.

    python benchmarks/learning_seeds.py --out seeds --estimators gae dapo --seeds 0 1 2 3 4 --threads 1 2

Makes the test's SFT checkpoint once (in --out), then runs the test's PPO for every estimator × seed × thread count,
each in its own process (`trainer.seed` and `generator.seed`: the critic's initialisation and the sampling;
`torch.set_num_threads`), and prints the validation success by step and
whether it reached the test's target, then a markdown table (docs/ppo.md "Seed table"). Runs already in --out are
read back, not rerun.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "trainer"))
sys.path.insert(0, str(REPO))

from test_learning import CONFIG, SUCCESS, TARGET, VARIANTS, bandit_sft_checkpoint  # noqa: E402

PPO_RUN = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from SPA_agent.config import compose
from SPA_agent.trainer.main_ppo import run
run(compose(sys.argv[2], sys.argv[3:]))
"""


def curve_of(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    records = [json.loads(line) for line in lines]
    return {r["step"]: r[SUCCESS] for r in records if SUCCESS in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory of the SFT checkpoint and the runs")
    parser.add_argument("--estimators", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()

    checkpoint_file = args.out / "sft_checkpoint.txt"
    if not checkpoint_file.exists():
        args.out.mkdir(parents=True, exist_ok=True)
        checkpoint_file.write_text(str(bandit_sft_checkpoint(args.out / "sft", [])))
    checkpoint = checkpoint_file.read_text()
    rows = []
    for estimator in args.estimators:
        for threads in args.threads:
            for seed in args.seeds:
                run_dir = args.out / f"{estimator}_seed{seed}_threads{threads}"
                curve = curve_of(run_dir)
                if not curve:
                    overrides = [f"model_path={checkpoint}", *VARIANTS[estimator], f"trainer.seed={seed}",
                                 f"generator.seed={seed}", f"trainer.default_local_dir={run_dir}"]
                    done = subprocess.run([sys.executable, "-c", PPO_RUN, str(threads), CONFIG, *overrides],
                                          capture_output=True, text=True, cwd=REPO)
                    curve = curve_of(run_dir)
                    if done.returncode != 0:
                        print(f"{estimator} seed {seed} threads {threads}: failed: {done.stderr.strip()[-300:]}")
                final = curve.get(max(curve, default=-1))
                passed = final is not None and final >= TARGET
                rows.append((estimator, seed, threads, curve, passed))
                print(f"{estimator} seed {seed} threads {threads}: {curve} {'pass' if passed else 'FAIL'}", flush=True)
    print("\n| estimator | seed | threads | validation success by step | ≥ target |\n|---|---|---|---|---|")
    for estimator, seed, threads, curve, passed in rows:
        steps = ", ".join(f"{step}: {value:.2f}" for step, value in sorted(curve.items()))
        print(f"| {estimator} | {seed} | {threads} | {steps} | {'yes' if passed else 'no'} |")


if __name__ == "__main__":
    main()

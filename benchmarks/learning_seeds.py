"""A learning test of tests/trainer/test_learning.py over PPO seeds and torch thread counts.

    python benchmarks/learning_seeds.py --out seeds --estimators gae dapo --seeds 0 1 2 3 4 --threads 1 2
    python benchmarks/learning_seeds.py --out seeds --test three_turn

`--test one_turn` is test_ppo_learns_the_bandit_from_chance (its estimators: VARIANTS), `--test three_turn` is
test_ppo_learns_a_three_turn_bandit (the config's estimator, gae). Makes the test's SFT checkpoint once (in
--out/<test>; both tests' checkpoints learn from the same one-turn data, the three-turn one at a lower lr), then
runs the test's PPO for every estimator × seed × thread count, each in its own process
(`trainer.seed` and `generator.seed`: the critic's initialisation and the sampling; `torch.set_num_threads`), and
prints the validation success by step and whether the last step reached the test's target, then a markdown table
(docs/ppo.md "Seed table"). Runs already in --out are read back, not rerun. `--override KEY=VALUE` (repeatable)
is passed to every PPO run after the test's overrides, e.g. `--override actor_rollout_ref.actor.optim.lr=5e-4`.
Run directories are named by estimator, seed and threads only, so give each set of overrides its own --out; one
holding a copy of another --out's <test>/sft_checkpoint.txt reuses that SFT checkpoint.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "trainer"))
sys.path.insert(0, str(REPO))

from test_learning import (  # noqa: E402
    CONFIG,
    MULTI_TURN,
    MULTI_TURN_PPO,
    MULTI_TURN_TARGET,
    SFT_CHECKPOINTS,
    SUCCESS,
    TARGET,
    VARIANTS,
    bandit_sft_checkpoint,
)

from SPA_agent.config import compose  # noqa: E402

PPO_RUN = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from SPA_agent.config import compose
from SPA_agent.trainer.main_ppo import run
run(compose(sys.argv[2], sys.argv[3:]))
"""


class LearningTest(NamedTuple):
    env_overrides: list[str]  # of its SFT checkpoint, as its fixture passes them to bandit_sft_checkpoint
    sft_overrides: list[str]
    variants: dict[str, list[str]]  # PPO overrides by estimator
    target: float  # of the validation success at the last step


TESTS = {
    "one_turn": LearningTest([], [], VARIANTS, TARGET),
    # from its own SFT checkpoint of the one-turn data (a lower lr), as the test (docs/ppo.md "Multi-turn")
    "three_turn": LearningTest([], SFT_CHECKPOINTS["three_turn"], {"gae": [*MULTI_TURN, *MULTI_TURN_PPO]},
                               MULTI_TURN_TARGET),
}


def curve_of(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    records = [json.loads(line) for line in lines]
    return {r["step"]: r[SUCCESS] for r in records if SUCCESS in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory of the SFT checkpoints and the runs")
    parser.add_argument("--test", choices=list(TESTS), default="one_turn")
    parser.add_argument("--estimators", nargs="+", help="of the test's estimators (default: all of them)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override of every PPO run (repeatable)")
    args = parser.parse_args()
    test = TESTS[args.test]
    estimators = args.estimators or list(test.variants)
    if unknown := set(estimators) - set(test.variants):
        parser.error(f"--test {args.test} has no estimator {sorted(unknown)}; its estimators: {list(test.variants)}")

    root = args.out / args.test
    checkpoint_file = root / "sft_checkpoint.txt"
    if not checkpoint_file.exists():
        root.mkdir(parents=True, exist_ok=True)
        checkpoint_file.write_text(str(bandit_sft_checkpoint(root / "sft", test.env_overrides, test.sft_overrides)))
    checkpoint = checkpoint_file.read_text()
    rows = []
    for estimator in estimators:
        for threads in args.threads:
            for seed in args.seeds:
                run_dir = root / f"{estimator}_seed{seed}_threads{threads}"
                overrides = [f"model_path={checkpoint}", *test.variants[estimator], f"trainer.seed={seed}",
                             f"generator.seed={seed}", *args.override, f"trainer.default_local_dir={run_dir}"]
                curve = curve_of(run_dir)
                if not curve:
                    done = subprocess.run([sys.executable, "-c", PPO_RUN, str(threads), CONFIG, *overrides],
                                          capture_output=True, text=True, cwd=REPO)
                    curve = curve_of(run_dir)
                    if done.returncode != 0:
                        print(f"{estimator} seed {seed} threads {threads}: failed: {done.stderr.strip()[-300:]}")
                final = curve.get(compose(CONFIG, overrides).trainer.total_training_steps)
                passed = final is not None and final >= test.target
                rows.append((estimator, seed, threads, curve, passed))
                print(f"{estimator} seed {seed} threads {threads}: {curve} {'pass' if passed else 'FAIL'}", flush=True)
    print("\n| estimator | seed | threads | validation success by step | ≥ target |\n|---|---|---|---|---|")
    for estimator, seed, threads, curve, passed in rows:
        steps = ", ".join(f"{step}: {value:.2f}" for step, value in sorted(curve.items()))
        print(f"| {estimator} | {seed} | {threads} | {steps} | {'yes' if passed else 'no'} |")


if __name__ == "__main__":
    main()

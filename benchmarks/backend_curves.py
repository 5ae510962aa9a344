"""Learning curves of the two backends side by side (benchmarks/backend_parity.sh's output).

    python benchmarks/backend_curves.py <parity_out_dir> --out curves.png

Reads every `<backend>_seed<s>.jsonl` there and draws, per step, the validation success, the mean training
score, the policy's entropy and the approximate KL of the actor update (old vs new policy), one line per run
(colour = backend). Prints the same numbers as a markdown table (steps with validation only for the success).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = (("val-env/Bandit/success", "validation success"), ("critic/score/mean", "mean training score"),
          ("actor/entropy", "entropy"), ("actor/ppo_kl", "KL (old → new policy)"))
COLOURS = {"local": "tab:blue", "verl": "tab:orange"}


def read_runs(directory: Path) -> dict[str, list[dict]]:
    runs = {}
    for path in sorted(directory.glob("*_seed*.jsonl")):
        runs[path.stem] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return runs


def curve(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def markdown(runs: dict[str, list[dict]]) -> str:
    lines = []
    for key, title in PANELS:
        steps = sorted({s for records in runs.values() for s in curve(records, key)})
        lines += [f"**{title}** (`{key}`)", "", "| run | " + " | ".join(map(str, steps)) + " |",
                  "|---|" + "---|" * len(steps)]
        for name, records in runs.items():
            values = curve(records, key)
            lines.append(f"| {name} | " + " | ".join(f"{values[s]:.3f}" if s in values else "" for s in steps) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--out", type=Path, default=Path("backend_curves.png"))
    args = parser.parse_args()
    runs = read_runs(args.directory)
    if not runs:
        parser.exit(2, f"error: no <backend>_seed<s>.jsonl files in {args.directory}\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (key, title) in zip(axes, PANELS):
        for name, records in runs.items():
            values = curve(records, key)
            backend = name.split("_seed")[0]
            ax.plot(list(values), list(values.values()), marker="o", ms=3, color=COLOURS.get(backend),
                    label=name, alpha=0.85)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(markdown(runs))


if __name__ == "__main__":
    main()

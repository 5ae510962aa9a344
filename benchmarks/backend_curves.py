"""Learning curves of the two backends side by side (benchmarks/backend_parity.sh, backend_parity_sokoban.sh).

    python benchmarks/backend_curves.py <parity_out_dir> --out curves.png

Reads every `<backend>_seed<s>.jsonl` there and draws, per step, the validation success, the mean training
score, the policy's entropy and the approximate KL of the actor update (old vs new policy; 0 where each batch
is one mini-batch, so the update starts from the rollout policy), one line per run
(colour = backend); validation success with its 95% Wilson interval over --val-episodes episodes (the bandit's
16 groups × 4; Sokoban's 128 puzzles × the validation samples). The environment is read from the metrics
(`val-env/<env>/success`); where the runs log the KL to the reference model (`diag/kl_ref`) and the share of
well-formed training turns (`train/diag/format_valid`), they are drawn too. Prints the same numbers as a markdown
table (steps with validation only for the success).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

TRAINING_PANELS = (("critic/score/mean", "mean training score"), ("actor/entropy", "entropy"),
                   ("actor/ppo_kl", "KL (old → new policy)"), ("diag/kl_ref", "KL to the reference model"),
                   ("train/diag/format_valid", "well-formed training turns"))
COLOURS = {"local": "tab:blue", "verl": "tab:orange"}


def read_runs(directory: Path) -> dict[str, list[dict]]:
    runs = {}
    for path in sorted(directory.glob("*_seed*.jsonl")):
        runs[path.stem] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return runs


def curve(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def wilson(rate: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate over n episodes."""
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def panels(runs: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """(metric, title) to draw: the validation success of the runs' environment first, then the training metrics
    that at least one run logs with a value other than 0 (the update's KL is 0 throughout where every batch is
    one mini-batch)."""
    keys = {key for records in runs.values() for record in records for key in record}
    success = sorted(key for key in keys if re.fullmatch(r"val-env/[^/]+/success", key))
    if len(success) != 1:
        raise ValueError(f"expected the validation success of one environment, found {success or 'none'}")
    logged = {key for records in runs.values() for record in records for key, value in record.items() if value}
    return [(success[0], "validation success")] + [panel for panel in TRAINING_PANELS if panel[0] in logged]


def cell(key: str, value: float, episodes: int) -> str:
    if not key.startswith("val-env/"):
        return f"{value:.3f}"
    low, high = wilson(value, episodes)
    return f"{value:.2f} [{low:.2f}, {high:.2f}]"


def markdown(runs: dict[str, list[dict]], episodes: int) -> str:
    lines = []
    for key, title in panels(runs):
        steps = sorted({s for records in runs.values() for s in curve(records, key)})
        lines += [f"**{title}** (`{key}`)", "", "| run | " + " | ".join(map(str, steps)) + " |",
                  "|---|" + "---|" * len(steps)]
        for name, records in runs.items():
            values = curve(records, key)
            cells = (cell(key, values[s], episodes) if s in values else "" for s in steps)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def panel_grid(count: int, columns: int):
    """A matplotlib figure (Agg) of `count` panels in rows of `columns`; (figure, the panels' axes in order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(count / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    axes = axes.ravel()
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--out", type=Path, default=Path("backend_curves.png"))
    parser.add_argument("--val-episodes", type=int, default=64, help="episodes per validation (the interval's n)")
    args = parser.parse_args()
    runs = read_runs(args.directory)
    if not runs:
        parser.exit(2, f"error: no <backend>_seed<s>.jsonl files in {args.directory}\n")
    try:
        drawn = panels(runs)
    except ValueError as error:
        parser.exit(2, f"error: {args.directory}: {error}\n")
    fig, axes = panel_grid(len(drawn), len(drawn) if len(drawn) <= 4 else math.ceil(len(drawn) / 2))
    for ax, (key, title) in zip(axes, drawn):
        for name, records in runs.items():
            values = curve(records, key)
            backend = name.split("_seed")[0]
            steps, ys = list(values), list(values.values())
            ax.plot(steps, ys, marker="o", ms=3, color=COLOURS.get(backend), label=name, alpha=0.85)
            if key == drawn[0][0]:
                bounds = [wilson(y, args.val_episodes) for y in ys]
                ax.fill_between(steps, [b[0] for b in bounds], [b[1] for b in bounds], color=COLOURS.get(backend),
                                alpha=0.12)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(markdown(runs, args.val_episodes))


if __name__ == "__main__":
    main()

"""Learning curves of a PPO settings study side by side (benchmarks/smollm2_sweep.sh, issue 43).

    python benchmarks/study_curves.py <sweep_out>/ppo/_2_sokoban --out curves.png --val-episodes 512
    python benchmarks/study_curves.py table2_wm/ppo/_2_sokoban table2_nowm/ppo/_2_sokoban ...   # several sweeps
    python benchmarks/study_curves.py @docs/results/smollm2_study300/grpo_guard_runs.txt --by-row   # listed runs

Reads `<run>/metrics.jsonl` (or its gzip-compressed `metrics.jsonl.gz`) of every run directory there (one arm each;
with several folders, the arms of all of them, whose names must differ; a run directory given itself is that one arm,
and `NAME=RUN` names the run directory RUN's arm NAME, e.g. a seed run again from another SFT checkpoint) and draws,
per PPO step and one line per arm: the validation success with its 95% Wilson interval over --val-episodes episodes
(128 puzzles × the validation samples), the training success, the share of well-formed training turns, the entropy of
the answer span, the KL to the reference model (all trained tokens, the answers, the state blocks), the critic's
explained variance, the tokens a training trajectory sampled (its mean), the step's seconds and, on a GPU, its peak
memory and the memory its process held, and in add_worldmodel prompts the validation's world-model accuracy (the share
of turns whose written observation, and prediction, is exactly the true current and next state; no interval: its count
is turns, not episodes) (panels no arm logs are left out). Prints the validation success per arm and step as a
markdown table, with the intervals, and each arm's last step. `@FILE` reads arguments from FILE, one a line (`#`
comments and blank lines skipped).

--by-row colours the arms by row, for many seeds of few settings: the arms `<row>_s<seed>` of one row (as in
table2_rows.py) share a colour and one legend entry, and the validation success panel draws each row's mean over
its seeds with a 95% Wilson interval over the pooled episodes (seeds × --val-episodes): bold while every seed of the
row is in it, dashed from where seeds that stopped earlier drop out (at least two left); the seeds' own validation
curves are thin lines without intervals."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_curves import curve, panel_grid, wilson  # noqa: E402

from SPA_agent.runs.metrics_file import jsonl_in, read_records  # noqa: E402

PANELS = (("val-env/{env}/success", "validation success"), ("train/{env}/success", "training success"),
          ("train/diag/format_valid", "well-formed training turns"), ("diag/entropy/answer", "answer-span entropy"),
          ("diag/kl_ref", "KL to the reference model"), ("diag/kl_ref/answer", "KL to the reference: answers"),
          ("diag/kl_ref/state", "KL to the reference: state blocks"),
          ("critic/vf_explained_var", "critic explained variance"),
          ("train/response_length", "sampled tokens a trajectory (training)"), ("timing_s/step", "seconds a step"),
          ("memory_gb/step", "GPU memory: the step's peak, GiB"), ("memory_gb/reserved", "GPU memory held, GiB"),
          ("val-env/{env}/worldmodel/observation_exact", "validation: observation exact"),
          ("val-env/{env}/worldmodel/prediction_exact", "validation: prediction exact"))


class RunsParser(argparse.ArgumentParser):
    """Arguments from `@FILE` too, one a line, blank lines and `#` comments skipped: a file that lists the runs behind
    a result (docs/results/smollm2_study300/grpo_guard_runs.txt), so that one command reproduces it."""

    def __init__(self, **kwargs):
        super().__init__(fromfile_prefix_chars="@", formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        line = arg_line.strip()
        return [] if not line or line.startswith("#") else [line]

    def add_runs_argument(self) -> None:
        """The positional `directories`, read by `read_folders`."""
        self.add_argument("directories", type=Path, nargs="+",
                          help="folders holding one run directory per arm, run directories (one arm each), or "
                               "NAME=RUN: the run directory RUN as the arm NAME")


def metrics_file(run: Path) -> Path | None:
    """A run directory's metrics.jsonl, or its gzip-compressed metrics.jsonl.gz."""
    return jsonl_in(run, "metrics.jsonl")


def run_dirs(directory: Path) -> list[Path]:
    """The runs a directory argument names: every `<arm>/` under `directory` that holds metrics.jsonl[.gz], or
    `directory` alone where it is a run directory itself (one arm of a folder whose other arms are left out)."""
    if metrics_file(directory):
        return [directory]
    return sorted(path for path in directory.glob("*") if path.is_dir() and metrics_file(path))


def named_runs(argument: Path) -> list[tuple[str, Path]]:
    """(arm, run directory) for a directory argument: its runs (`run_dirs`) under their directories' names, or for
    `NAME=RUN` the run directory RUN as the arm NAME. That names a seed run again from another SFT checkpoint, whose
    directory has the earlier run's name: `grpo_guard_s4b=lease6/.../grpo_guard_s4` (a letter after the seed keeps it
    in its row)."""
    name, equals, run = str(argument).partition("=")
    if equals and name and "/" not in name:
        if not metrics_file(Path(run)):
            raise ValueError(f"{argument}: {run} holds no metrics.jsonl")
        return [(name, Path(run))]
    return [(path.name, path) for path in run_dirs(argument)]


def read_arms(directory: Path) -> dict[str, list[dict]]:
    """{arm: its metrics records} for the runs of a directory argument (`named_runs`); a cut-short line dropped."""
    arms = {}
    for name, run in named_runs(directory):
        arms[name], _ = read_records(metrics_file(run))
    return arms


def environment(arms: dict[str, list[dict]]) -> str:
    names = {key.split("/")[1] for records in arms.values() for record in records for key in record
             if key.startswith("val-env/") and key.endswith("/success") and key.count("/") == 2}
    if len(names) != 1:
        raise ValueError(f"expected the validation success of one environment, found {sorted(names) or 'none'}")
    return names.pop()


def read_folders(parser: argparse.ArgumentParser, directories: list[Path]) -> dict[str, list[dict]]:
    """The arms of every folder, of one environment; an arm's name twice, no arm, or no environment's validation
    success is a one-line error (exit 2)."""
    folders = " ".join(map(str, directories))
    arms: dict[str, list[dict]] = {}
    for directory in directories:
        try:
            named = read_arms(directory)
        except ValueError as error:
            parser.exit(2, f"error: {error}\n")
        for name, records in named.items():
            if name in arms:
                parser.exit(2, f"error: two arms are named {name}, one in {directory}: give each its own name "
                               "(NAME=RUN)\n")
            arms[name] = records
    if not arms:
        parser.exit(2, f"error: no <arm>/metrics.jsonl under {folders}\n")
    try:
        environment(arms)
    except ValueError as error:
        parser.exit(2, f"error: {folders}: {error}\n")
    return arms


SEED = re.compile(r"(?P<row>.+)_s(?P<seed>\d+[a-z]?)")  # s4b: seed 4 again, from another SFT checkpoint


def rows_of(arms: dict[str, list[dict]]) -> dict[str, list[str]]:
    """{row: its arms}, in the order the rows first appear; an arm without `_s<seed>` is a row of its own."""
    rows: dict[str, list[str]] = {}
    for name in arms:
        match = SEED.fullmatch(name)
        rows.setdefault(match["row"] if match else name, []).append(name)
    return rows


def row_means(arms: dict[str, list[dict]], names: list[str], key: str) -> dict[int, tuple[float, int]]:
    """{step: (the mean of `key` over the arms `names` that logged it there, how many did)} at the steps where at
    least two of them did (all of them for a row of one arm)."""
    values = [curve(arms[name], key) for name in names]
    least = min(2, len(names))
    means = {}
    for step in sorted({step for v in values for step in v}):
        logged = [v[step] for v in values if step in v]
        if len(logged) >= least:
            means[step] = (sum(logged) / len(logged), len(logged))
    return means


def panels(arms: dict[str, list[dict]]) -> list[tuple[str, str]]:
    env = environment(arms)
    logged = {key for records in arms.values() for record in records for key in record}
    return [(key.format(env=env), title) for key, title in PANELS if key.format(env=env) in logged]


def markdown(arms: dict[str, list[dict]], key: str, episodes: int) -> str:
    steps = sorted({s for records in arms.values() for s in curve(records, key)})
    lines = ["| arm | " + " | ".join(f"step {s}" for s in steps) + " | last step |",
             "|---|" + "---|" * (len(steps) + 1)]
    for name, records in arms.items():
        values = curve(records, key)
        cells = []
        for step in steps:
            if step not in values:
                cells.append("")
                continue
            low, high = wilson(values[step], episodes)
            cells.append(f"{values[step]:.3f} [{low:.3f}, {high:.3f}]")
        last = max((r["step"] for r in records if "step" in r), default=0)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {last} |")
    return "\n".join(lines)


def main() -> None:
    parser = RunsParser(description=__doc__)
    parser.add_runs_argument()
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    parser.add_argument("--val-episodes", type=int, default=512, help="episodes per validation (the interval's n)")
    parser.add_argument("--by-row", action="store_true",
                        help="one colour per row (<row>_s<seed>) and the row's mean validation success over its seeds")
    args = parser.parse_args()
    arms = read_folders(parser, args.directories)
    drawn = panels(arms)
    import matplotlib.pyplot as plt

    fig, axes = panel_grid(len(drawn), min(4, len(drawn)))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4
    rows = rows_of(arms) if args.by_row else {name: [name] for name in arms}
    colours = {name: palette[i] for i, names in enumerate(rows.values()) for name in names}
    labels = {names[0]: f"{row} ({len(names)} seeds)" if args.by_row else row for row, names in rows.items()}
    for ax, (key, title) in zip(axes, drawn):
        validation = key.startswith("val-env/")
        success = validation and key.endswith("/success")  # the interval's n is episodes
        for name, records in arms.items():
            values = curve(records, key)
            steps, ys = list(values), list(values.values())
            ax.plot(steps, ys, marker="o" if validation and not args.by_row else None, ms=3,
                    lw=1.2 if validation and not args.by_row else 0.8, color=colours[name],
                    label=labels.get(name), alpha=0.85)
            if success and not args.by_row:
                bounds = [wilson(y, args.val_episodes) for y in ys]
                ax.fill_between(steps, [b[0] for b in bounds], [b[1] for b in bounds], color=colours[name],
                                alpha=0.12)
        for names in rows.values() if args.by_row and success else ():
            means = row_means(arms, names, key)
            steps = list(means)
            ys, counts = [means[s][0] for s in steps], [means[s][1] for s in steps]
            whole = [i for i, n in enumerate(counts) if n == len(names)]  # solid while every seed is in the mean
            cut = whole[-1] + 1 if whole else 0
            ax.plot(steps[:cut], ys[:cut], marker="o", ms=4, lw=2.4, color=colours[names[0]])
            ax.plot(steps[max(cut - 1, 0):], ys[max(cut - 1, 0):], marker="o", ms=3, lw=1.6, ls="--",
                    color=colours[names[0]])
            bounds = [wilson(y, args.val_episodes * n) for y, n in zip(ys, counts)]
            ax.fill_between(steps, [b[0] for b in bounds], [b[1] for b in bounds], color=colours[names[0]], alpha=0.15)
        if key == "critic/vf_explained_var":  # returns that barely vary (no success yet) give any large negative
            ax.set_ylim(max(ax.get_ylim()[0], -1.0), 1.0)
            title += " (from −1)"
        if success and args.by_row:
            title += ": each seed, and the row's mean"
        ax.set_title(title)
        ax.set_xlabel("PPO step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(markdown(arms, drawn[0][0], args.val_episodes))


if __name__ == "__main__":
    main()

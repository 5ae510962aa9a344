r"""Each row's training metrics averaged over windows of PPO steps (issue 43): what differs between settings before
their validation success does.

    python benchmarks/row_metrics.py @docs/results/smollm2_study300/grpo_guard_runs.txt --windows 1:25 26:100 \
        --keys rollout/in_group_std diag/kl_ref/answer diag/entropy/answer

Reads the runs as study_curves.py does (folders of run directories, run directories, NAME=RUN, `@FILE`) and groups
them into rows as table2_rows.py does (`<row>_s<seed>`). For each window A:B (steps A to B, both included) and each
key, a row's cell is the mean over its arms of each arm's mean over the steps of the window at which it logged the
key, with the number of those arms in brackets; a row none of whose arms logged the key in the window has an empty
cell. Each arm counts once whatever its steps, so that a seed that ran longer does not weigh more. Prints one
markdown table per window.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_curves import curve  # noqa: E402
from study_curves import RunsParser, read_folders, rows_of  # noqa: E402


def window(text: str) -> tuple[int, int]:
    """FIRST:LAST as (FIRST, LAST), two steps with FIRST <= LAST; anything else is a ValueError (a usage error)."""
    first, sep, last = text.partition(":")
    if not (sep and first.isdigit() and last.isdigit() and int(first) <= int(last)):
        raise ValueError(f"a window is FIRST:LAST, two steps with FIRST <= LAST, got {text!r}")
    return int(first), int(last)


def arm_mean(records: list[dict], key: str, first: int, last: int) -> float | None:
    values = [value for step, value in curve(records, key).items() if first <= step <= last]
    return statistics.fmean(values) if values else None


def row_cell(arms: dict[str, list[dict]], names: list[str], key: str, first: int, last: int) -> str:
    means = [m for name in names if (m := arm_mean(arms[name], key, first, last)) is not None]
    return f"{statistics.fmean(means):.4f} ({len(means)})" if means else ""


def table(arms: dict[str, list[dict]], keys: list[str], first: int, last: int) -> str:
    lines = [f"steps {first}–{last}", "", "| row | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for row, names in rows_of(arms).items():
        lines.append(f"| {row} | " + " | ".join(row_cell(arms, names, key, first, last) for key in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = RunsParser(description=__doc__)
    parser.add_runs_argument()
    parser.add_argument("--windows", nargs="+", required=True, metavar="FIRST:LAST",
                        help="windows of PPO steps, both ends included (1:25 26:100)")
    parser.add_argument("--keys", nargs="+", required=True, metavar="KEY",
                        help="metrics.jsonl keys (diag/kl_ref/answer rollout/in_group_std ...)")
    args = parser.parse_args()
    try:
        windows = [window(text) for text in args.windows]
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    arms = read_folders(parser, args.directories)
    logged = {key for records in arms.values() for record in records for key in record}
    missing = [key for key in args.keys if key not in logged]
    if missing:
        parser.exit(2, f"error: no arm logs {', '.join(missing)}\n")
    print("\n\n".join(table(arms, args.keys, first, last) for first, last in windows))


if __name__ == "__main__":
    main()

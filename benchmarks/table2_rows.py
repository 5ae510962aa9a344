"""Issue 43's Table 2 rows from the arms of Table 2 leases (docs/results/smollm2_table2): one row per setting, its
seeds pooled.

    python benchmarks/table2_rows.py lease1/table2_wm/ppo/_2_sokoban lease1/table2_nowm/ppo/_2_sokoban \\
        lease2/table2_wm/ppo/_2_sokoban ... --val-episodes 512
    python benchmarks/table2_rows.py @docs/results/smollm2_study300/grpo_guard_runs.txt --step 275 \\
        --compare grpo_guard format_grpo_guard   # the runs a file lists (`#` comments skipped), one a line

An arm `<row>_s<seed>` (spa_s0, format_s1, ...) belongs to row `<row>`; arms of several folders and leases are read
together (their names must differ, as in study_curves.py; a run directory given itself is one arm; `NAME=RUN` names
it: `grpo_guard_s4b=lease6/.../grpo_guard_s4`, seed 4 again from another SFT checkpoint, in row grpo_guard). A row's
success at a validation step is the mean of its seeds' success there, with a 95% Wilson interval over the pooled
episodes (seeds × --val-episodes). The seeds validate on the same puzzles, so the pooled episodes are not independent
and the interval is narrower than one that allows for the puzzles; the seeds' own values are printed beside it. Two
columns: step 0 (the start: Base for Vanilla RL, SFT-only for the others) and --step, by default the last validation
step that every arm reached, so that every row is compared after the same number of PPO steps.
Arms that have not validated at that step are left out of a row and named below the table; a step that no
arm validated is an error that lists the arms' validation steps.
Where a row's arms log it (add_worldmodel prompts), the world model's accuracy before and after PPO: the share of
turns whose observation is exactly the current state, and whose prediction is exactly the next one.

--compare ROW_A ROW_B compares two rows at --step over their seeds, each seed's success one observation: the
difference of the rows' means with Welch's 95% interval (between-seed spread, which the pooled Wilson intervals
leave out) and the exact permutation test of the seeds' labels (one-sided: ROW_A above; with 3 seeds a row, all
three above all three has p = 1/20). Seeds of one sweep (`<sweep>/ppo/<config>/<arm>`) start from one SFT checkpoint,
and the 300-step study saw one checkpoint change how all its seeds trained; where a row has several seeds of one
checkpoint, a second line makes the same comparison over checkpoints, each checkpoint's seeds averaged into one
observation (less independence assumed, less power). A last line says what the seeds can resolve: with the two rows'
seed spreads, the difference a two-sided 5% test finds 80% of the time at the rows' seed counts, and the seeds a row
that would find the observed difference as often (normal approximation; a planning figure, not a test). A row with
one seed at the step has no spread: no Welch interval and no power line, only the permutation test (its seed's rank
among the pooled ones).

Arms whose sweep ran with WM_EVAL=1 (benchmarks/smollm2_sweep.sh: `<sweep>/wm_eval/<arm>/eval.json`, beside
`<sweep>/ppo/`) get one more table: their last checkpoint in the SFT's own prompts, success and the world model's
accuracy, which a PPO in base prompts never shows.

--count-stopped counts the runs that `trainer.stop_after_uniform_scores` ended (every trajectory scored alike in the
last N steps: a format collapse, GRPO's advantages all 0) at --step with the validation of their stop, instead of
leaving them out as runs cut short are: no reward difference was left to learn from, so they are the recipe's
failures, not missing data. That they would not have recovered is an assumption (the Vanilla RL arm, run on with
uniform scores, never did); the output names the runs it carried.

--onset LEVEL adds each arm's onset: the first validation step from which its success stays at or above LEVEL up to
its last validation (e.g. the SFT-only model's success + 0.05). Seeds of one setting rose ~75 steps apart in the
300-step study, so a row compared at one step can measure when its seeds rose more than where they go. With
--compare, the two rows' onsets are compared as times to an event: a run without an onset is censored at its last
validation (a lease cut it short: it might have risen later), so every run counts, not only those that reached
--step; with --count-stopped a run the stop rule ended never rises (it stays at risk to the end). The line gives
each row's Kaplan–Meier median onset and the log-rank test (normal approximation; z > 0: ROW_A rises earlier).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_curves import curve, wilson  # noqa: E402
from study_curves import RunsParser, environment, named_runs, read_folders, rows_of  # noqa: E402


def common_step(arms: dict[str, list[dict]], key: str) -> int:
    """The last validation step that every arm reached."""
    return min(max(curve(records, key), default=0) for records in arms.values())


def cell(values: list[float], episodes: int) -> str:
    mean = sum(values) / len(values)
    low, high = wilson(mean, episodes * len(values))
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def before_after(arms: dict[str, list[dict]], names: list[str], key: str, step: int) -> str:
    """`<mean at step 0> → <mean at step>` of `key` over the arms `names`; empty unless every one logs both."""
    values = [curve(arms[name], key) for name in names]
    if not all(0 in value and step in value for value in values):
        return ""
    return f"{sum(v[0] for v in values) / len(values):.3f} → {sum(v[step] for v in values) / len(values):.3f}"


def table(arms: dict[str, list[dict]], step: int, episodes: int) -> str:
    env = environment(arms)
    success, world_model = f"val-env/{env}/success", f"val-env/{env}/worldmodel"
    lines = [f"| row | seeds | step 0 | step {step} | gain | each seed at step {step} "
             f"| observation exact, step 0 → {step} | prediction exact, step 0 → {step} |",
             "|---|---|---|---|---|---|---|---|"]
    missing = []
    for row, names in rows_of(arms).items():
        reached = [name for name in names if step in curve(arms[name], success)]
        missing += [name for name in names if name not in reached]
        if not reached:
            continue
        start = [curve(arms[name], success)[0] for name in reached if 0 in curve(arms[name], success)]
        end = [curve(arms[name], success)[step] for name in reached]
        gain = f"{sum(end) / len(end) - sum(start) / len(start):+.3f}" if len(start) == len(end) else ""
        seeds = ", ".join(f"{curve(arms[name], success)[step]:.3f}" for name in reached)
        observed = before_after(arms, reached, f"{world_model}/observation_exact", step)
        predicted = before_after(arms, reached, f"{world_model}/prediction_exact", step)
        lines.append(f"| {row} | {len(reached)} | {cell(start, episodes) if start else ''} | {cell(end, episodes)} "
                     f"| {gain} | {seeds} | {observed} | {predicted} |")
    if missing:
        lines.append(f"\nnot validated at step {step}: {', '.join(missing)}")
    return "\n".join(lines)


def t_quantile(probability: float, df: float) -> float:
    """Student's t quantile for probability in (0.5, 1): bisection on the CDF, whose density (fractional df
    allowed, as Welch's) is integrated by Simpson's rule."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, intervals: int = 4000) -> float:
        h = x / intervals
        density = [math.exp(log_norm - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(intervals + 1)]
        return 0.5 + h / 3 * (density[0] + density[-1] + 4 * sum(density[1:-1:2]) + 2 * sum(density[2:-1:2]))

    low, high = 0.0, 1.0
    while cdf(high) < probability:
        high *= 2
    for _ in range(60):
        low, high = (low, (low + high) / 2) if cdf((low + high) / 2) >= probability else ((low + high) / 2, high)
    return (low + high) / 2


def welch(a: list[float], b: list[float]) -> tuple[float, float, float, float]:
    """(mean(a) - mean(b), its 95% interval's low and high, Welch's degrees of freedom)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    difference = statistics.fmean(a) - statistics.fmean(b)
    if va + vb == 0:
        return difference, difference, difference, math.inf
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(0.975, df) * math.sqrt(va + vb)
    return difference, difference - half, difference + half, df


def permutation_p(a: list[float], b: list[float]) -> tuple[float, float]:
    """Exact permutation test of the difference of means over every split of the pooled seeds: (one-sided p of a
    above b, two-sided p)."""
    pooled, observed = a + b, statistics.fmean(a) - statistics.fmean(b)
    differences = [statistics.fmean([pooled[i] for i in chosen])
                   - statistics.fmean([pooled[i] for i in range(len(pooled)) if i not in chosen])
                   for chosen in itertools.combinations(range(len(pooled)), len(a))]
    tolerance = 1e-12
    one_sided = sum(d >= observed - tolerance for d in differences) / len(differences)
    two_sided = sum(abs(d) >= abs(observed) - tolerance for d in differences) / len(differences)
    return one_sided, two_sided


def sweep_of(run: Path) -> Path | None:
    """The sweep folder of a run `<sweep>/ppo/<config>/<arm>` (its SFT checkpoint, data and wm_eval/), or None."""
    run = run.resolve()
    return run.parents[2] if len(run.parents) > 2 and run.parents[1].name == "ppo" else None


def checkpoints_of(directories: list[Path]) -> dict[str, str]:
    """{arm: the sweep folder whose SFT checkpoint it started from (the run itself outside a sweep)} for the runs
    under `directories`."""
    return {name: str(sweep_of(run) or run.resolve()) for directory in directories
            for name, run in named_runs(directory)}


def comparison_line(first: str, second: str, a: list[float], b: list[float], step: int, unit: str) -> str:
    """The difference of the means with Welch's interval (where each row has two values: a variance needs them) and
    the exact permutation test (with one value in a row, its rank among the pooled values)."""
    one_sided, two_sided = permutation_p(a, b)
    if min(len(a), len(b)) < 2:
        single = first if len(a) < 2 else second
        spread = (f"{statistics.fmean(a) - statistics.fmean(b):+.3f}; one {unit} in row {single}: no interval over "
                  f"{unit}s (Welch's needs two a row)")
    else:
        difference, low, high, df = welch(a, b)
        spread = f"{difference:+.3f}, Welch 95% interval [{low:+.3f}, {high:+.3f}] (df {df:.1f})"
    return (f"{first} − {second} at step {step}, over {unit}s ({len(a)} and {len(b)}): {spread}; "
            f"exact permutation test of the {unit}s: one-sided p = {one_sided:.3f}, two-sided p = {two_sided:.3f}")


def power_line(a: list[float], b: list[float]) -> str:
    """What seeds with these spreads resolve: the difference that a two-sided 5% test finds with 80% power at
    len(a) and len(b) seeds, and the seeds a row (equal counts) for that power at the observed difference, both in
    the normal approximation (Welch's t needs a little more)."""
    z = statistics.NormalDist().inv_cdf(0.975) + statistics.NormalDist().inv_cdf(0.80)
    va, vb = statistics.variance(a), statistics.variance(b)
    detectable = z * math.sqrt(va / len(a) + vb / len(b))
    difference = abs(statistics.fmean(a) - statistics.fmean(b))
    if difference == 0:
        needed = "no number of"  # equal means: no seed count finds a difference
    else:
        needed = str(max(2, math.ceil(z**2 * (va + vb) / difference**2)))  # a variance needs two seeds
    return (f"power over seeds (80%, two-sided 5%, normal approximation): at {len(a)} and {len(b)} seeds a difference "
            f"of {detectable:.3f} is found; the observed {difference:.3f} needs {needed} seeds a row")


def named_rows(arms: dict[str, list[dict]], *names: str) -> dict[str, list[str]]:
    """{row: its arms} for the rows `names`; ValueError naming the rows there are for a row with no arm."""
    rows = rows_of(arms)
    for row in names:
        if row not in rows:
            raise ValueError(f"no row named {row} (rows: {', '.join(rows)})")
    return {row: rows[row] for row in names}


def compare(arms: dict[str, list[dict]], first: str, second: str, step: int,
            checkpoints: dict[str, str] | None = None) -> str:
    """The seed-level comparison of two rows at `step`, and over SFT checkpoints where `checkpoints` (arm -> its
    checkpoint) gives a row several seeds of one (module docstring)."""
    success, values, cells = f"val-env/{environment(arms)}/success", {}, {}
    for row, names in named_rows(arms, first, second).items():
        reached = [name for name in names if step in curve(arms[name], success)]
        values[row] = [curve(arms[name], success)[step] for name in reached]
        if not values[row]:
            raise ValueError(f"row {row} has no seed validated at step {step}")
        by_checkpoint: dict[str, list[float]] = {}
        for name, value in zip(reached, values[row]):
            by_checkpoint.setdefault((checkpoints or {}).get(name, name), []).append(value)
        cells[row] = [statistics.fmean(seeds) for seeds in by_checkpoint.values()]
    lines = [comparison_line(first, second, values[first], values[second], step, "seed")]
    if any(len(cells[row]) < len(values[row]) for row in cells):  # a checkpoint holds several seeds of a row
        few = [row for row in cells if len(cells[row]) < 2]
        lines.append(f"over SFT checkpoints: row {few[0]}'s seeds all start from one checkpoint, no comparison" if few
                     else comparison_line(first, second, cells[first], cells[second], step, "SFT checkpoint"))
    if min(len(values[first]), len(values[second])) > 1:  # the seeds' spread in both rows
        lines.append(power_line(values[first], values[second]))
    return "\n".join(lines)


def stopped_by_uniform_scores(run: Path, records: list[dict]) -> bool:
    """Whether `trainer.stop_after_uniform_scores` (the run's config.yaml) ended the run whose metrics are `records`:
    its last step's uniform-score streak reached it."""
    config = run / "config.yaml"
    threshold = OmegaConf.load(config).trainer.get("stop_after_uniform_scores") if config.is_file() else None
    streaks = [record["rollout/uniform_score_streak"] for record in records if "rollout/uniform_score_streak" in record]
    return threshold is not None and bool(streaks) and streaks[-1] >= threshold


def carry_stopped(arms: dict[str, list[dict]], directories: list[Path], step: int) -> tuple[dict, dict[str, str]]:
    """(`arms` with each run the stop rule ended before `step` given its last validation's success at `step`,
    {such a run: a note naming its stop}): --count-stopped (module docstring)."""
    success, carried, notes = f"val-env/{environment(arms)}/success", dict(arms), {}
    for directory in directories:
        for name, run in named_runs(directory):
            values = curve(arms[name], success)
            if values and max(values) < step and stopped_by_uniform_scores(run, arms[name]):
                last = max(values)
                carried[name] = [*arms[name], {"step": step, success: values[last]}]
                notes[name] = f"{name} ({values[last]:.3f} at step {last})"
    return carried, notes


def world_model_evaluations(directories: list[Path]) -> dict[str, dict]:
    """{arm: its eval.json} for the arms under `directories` (run folders or runs, as read_folders reads them) that
    have a WM_EVAL evaluation: `<sweep>/wm_eval/<arm>/eval.json` for a run `<sweep>/ppo/<config>/<arm>`."""
    found = {}
    for directory in directories:
        for name, run in named_runs(directory):
            sweep = sweep_of(run)
            evaluation = sweep / "wm_eval" / run.name / "eval.json" if sweep else None
            if evaluation is not None and evaluation.is_file():
                found[name] = json.loads(evaluation.read_text())
    return found


def world_model_table(evaluations: dict[str, dict], env: str) -> str:
    lines = ["| arm (last checkpoint, the SFT's own prompts) | success | observation exact | prediction exact |",
             "|---|---|---|---|"]
    for name, evaluation in evaluations.items():
        metrics = evaluation["metrics"].get(env, {})
        cells = [f"{metrics[key]:.3f}" if key in metrics else "" for key in
                 ("success", "worldmodel/observation_exact", "worldmodel/prediction_exact")]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def onset(values: dict[int, float], level: float) -> int | None:
    """The first validation step from which success stays at or above `level` to the last one; None if none."""
    steps = sorted(values)
    return next((step for i, step in enumerate(steps) if all(values[s] >= level for s in steps[i:])), None)


def onsets(arms: dict[str, list[dict]], level: float) -> str:
    success = f"val-env/{environment(arms)}/success"
    lines = [f"| row | arm | onset: success ≥ {level:.3f} from | last validation |", "|---|---|---|---|"]
    for row, names in rows_of(arms).items():
        for name in names:
            values = curve(arms[name], success)
            first = onset(values, level)
            lines.append(f"| {row} | {name} | {'—' if first is None else first} | {max(values, default='')} |")
    return "\n".join(lines)


def kaplan_meier_median(times: list[tuple[float, bool]]) -> float | None:
    """The first event time at which the Kaplan–Meier estimate of (time, event) pairs falls to 0.5 or below; None
    if it never does."""
    surviving = 1.0
    for time in sorted({t for t, event in times if event}):
        at_risk = sum(1 for t, _ in times if t >= time)
        surviving *= 1 - sum(1 for t, event in times if t == time and event) / at_risk
        if surviving <= 0.5:
            return time
    return None


def log_rank(a: list[tuple[float, bool]], b: list[tuple[float, bool]]) -> tuple[float, float]:
    """(z, two-sided p) of the log-rank test of two samples of (time, event) pairs, in the normal approximation;
    z > 0 when `a` has more events early than `b` (observed minus expected over the square root of the
    hypergeometric variance, summed over the event times)."""
    observed = expected = variance = 0.0
    for time in sorted({t for t, event in a + b if event}):
        at_risk_a, at_risk = sum(1 for t, _ in a if t >= time), sum(1 for t, _ in a + b if t >= time)
        events_a = sum(1 for t, event in a if t == time and event)
        events = events_a + sum(1 for t, event in b if t == time and event)
        observed += events_a
        expected += events * at_risk_a / at_risk
        if at_risk > 1:
            share = at_risk_a / at_risk
            variance += events * share * (1 - share) * (at_risk - events) / (at_risk - 1)
    if variance == 0:
        return 0.0, 1.0
    z = (observed - expected) / math.sqrt(variance)
    return z, 2 * (1 - statistics.NormalDist().cdf(abs(z)))


def onset_comparison(arms: dict[str, list[dict]], first: str, second: str, level: float,
                     never: set[str] | None = None) -> str:
    """The two rows' onsets (success >= `level` to the last validation) as times to an event: a run without one
    censored at its last validation, a run in `never` (the stop rule ended it) at risk to the end."""
    success, times = f"val-env/{environment(arms)}/success", {}
    for row, names in named_rows(arms, first, second).items():
        times[row] = []
        for name in names:
            values = curve(arms[name], success)
            first_step = onset(values, level)
            times[row].append((math.inf, False) if name in (never or set()) else
                              (first_step, True) if first_step is not None else (max(values), False))
    z, p = log_rank(times[first], times[second])

    def median(row: str) -> str:
        value = kaplan_meier_median(times[row])
        events = sum(event for _, event in times[row])
        return f"{'not reached' if value is None else value} ({events} of {len(times[row])} runs with an onset)"

    return (f"onset (success ≥ {level:.3f} to the last validation), runs without one censored at their last "
            f"validation{', the runs the stop rule ended never rising' if never else ''}: Kaplan–Meier median {first} "
            f"{median(first)}, {second} {median(second)}; log-rank z = {z:+.2f} ({first} earlier if > 0), "
            f"two-sided p = {p:.3f} (normal approximation)")


def main() -> None:
    parser = RunsParser(description=__doc__)
    parser.add_runs_argument()
    parser.add_argument("--val-episodes", type=int, default=512, help="episodes per validation of one arm")
    parser.add_argument("--step", type=int, help="the validation step to compare at (default: the last one that "
                                                 "every arm reached)")
    parser.add_argument("--count-stopped", action="store_true",
                        help="count runs the stop rule ended (a format collapse) at --step with their last validation")
    parser.add_argument("--onset", type=float, metavar="LEVEL",
                        help="also each arm's first validation step from which its success stays >= LEVEL (with "
                             "--compare: the two rows' onsets compared, Kaplan-Meier medians and the log-rank test)")
    parser.add_argument("--compare", nargs=2, metavar=("ROW_A", "ROW_B"),
                        help="also ROW_A - ROW_B at --step over seeds: Welch's interval, the permutation test")
    args = parser.parse_args()
    arms = read_folders(parser, args.directories)
    key = f"val-env/{environment(arms)}/success"
    step = common_step(arms, key) if args.step is None else args.step
    validated = sorted(set().union(*(curve(records, key) for records in arms.values())))
    if step not in validated:
        parser.exit(2, f"error: no arm validated at step {step} (the arms' validation steps: "
                       f"{', '.join(map(str, validated))})\n")
    observed, stopped = arms, {}
    if args.count_stopped:
        arms, stopped = carry_stopped(arms, args.directories, step)
        if stopped:
            print(f"counted at step {step} with the validation of their stop (--count-stopped): "
                  f"{', '.join(stopped.values())}\n")
    print(table(arms, step, args.val_episodes))
    if args.compare:
        try:
            print(f"\n{compare(arms, *args.compare, step, checkpoints_of(args.directories))}")
        except ValueError as error:
            parser.exit(2, f"error: {error}\n")
    evaluations = world_model_evaluations(args.directories)
    if evaluations:
        print(f"\n{world_model_table(evaluations, environment(arms))}")
    if args.onset is not None:
        print(f"\n{onsets(observed, args.onset)}")
        if args.compare:
            print(f"\n{onset_comparison(observed, *args.compare, args.onset, set(stopped))}")


if __name__ == "__main__":
    main()

"""Markdown table of our results, one row per run and env tag, beside the paper's reference numbers.

    python -m SPA_agent.report evals/_2_sokoban-tiny checkpoints/_2_sokoban/sokoban-main [--out report.md]

A run directory is an evaluation (eval.json, from `SPA_agent.evaluate`) or a PPO run (metrics.jsonl with
`val-env/<Tag>/success` and `val-env/<Tag>/pass@<G>`; its final and best validation steps are reported).
Numbers are percentages, as in the paper. Runs of a named experiment (`experiment=<name>`, config/experiment/)
are labelled with its name and the paper row it corresponds to, with the paper's numbers for that row, model
and env where the paper reports them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from SPA_agent.evaluation.paper_results import (
    ENVS,
    MAIN_RESULTS,
    MODEL_SIZE_TO_PAPER,
    SOURCE,
    TAG_TO_ENV,
    paper_numbers,
)
from SPA_agent.evaluation.plots import read_metrics_jsonl
from SPA_agent.runs import atomic_io

HEADER = ("| run | env | source | Pass@1 | any-of-n (Pass@n) | unbiased pass@k [95% CI] | puzzles × samples "
          "| status | experiment | paper row: the paper's numbers |\n|---|---|---|---|---|---|---|---|---|---|")


@dataclass(frozen=True)
class RunLabel:
    """The named experiment of a run (config/experiment/) and the paper model of its model preset."""

    experiment: str | None
    paper_row: str | None
    paper_model: str | None

    def cells(self, tag: str) -> str:
        """The `experiment` and `paper row` cells of a row for env `tag`."""
        if not self.experiment or not self.paper_row:
            return "— | —"
        numbers = paper_numbers(self.paper_row, self.paper_model, TAG_TO_ENV.get(tag, tag))
        return f"{self.experiment} | {self.paper_row}: {numbers}"


def run_label(config: Mapping | None) -> RunLabel:
    """The label of a run from its composed config (eval.json's `config`, a PPO run's config.yaml)."""
    config = config or {}
    info = config.get("experiment_info") or {}
    return RunLabel(info.get("name"), info.get("paper"), MODEL_SIZE_TO_PAPER.get(str(config.get("model_size"))))


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def eval_rows(run: Path, result: Mapping) -> list[str]:
    """Rows of an evaluation directory: one per env tag."""
    rows, n, label = [], result["n"], run_label(result.get("config"))
    status = "complete" if result["complete"] else f"INCOMPLETE ({result.get('error') or 'failed requests'})"
    for tag, m in result["metrics"].items():
        ks = sorted(int(x.group(1)) for key in m if (x := re.fullmatch(r"pass@(\d+)", key)))
        passk = "; ".join(f"@{k} {_pct(m[f'pass@{k}'])} [{_pct(m[f'pass@{k}_ci_low'])}, "
                          f"{_pct(m[f'pass@{k}_ci_high'])}]" for k in ks if k > 1) or "—"
        rows.append(f"| {run.name} | {tag} | eval: {result['model_name']} | {_pct(m.get('success'))} | "
                    f"{_pct(m.get(f'pass_any@{n}'))} (n={n}) | {passk} | "
                    f"{m.get('num_puzzles', '?')} × {n * result.get('repeats', 1)} | {status} | "
                    f"{label.cells(tag)} |")
    return rows


def ppo_rows(run: Path) -> list[str]:
    """Rows of a PPO run directory: the final validation step and the step with the best success, per tag."""
    rows, config_file = [], run / "config.yaml"
    experiment = run_label(OmegaConf.to_container(OmegaConf.load(config_file)) if config_file.is_file() else None)
    for tag, series in sorted(read_metrics_jsonl(run / "metrics.jsonl").items()):
        success = dict(series.get("success", []))
        any_key = next((k for k in sorted(series) if k.startswith("pass@")), None)
        any_n = dict(series.get(any_key, [])) if any_key else {}
        if not success:
            continue
        final, best = max(success), max(success, key=lambda s: (success[s], -s))
        for label, step in (("final", final), ("best", best)):
            rows.append(f"| {run.name} | {tag} | PPO {label} (step {step}) | {_pct(success[step])} | "
                        f"{_pct(any_n.get(step))} ({any_key or '—'}) | — | val | complete | {experiment.cells(tag)} |")
    return rows


def run_rows(run: Path) -> list[str]:
    """Rows of one run directory (eval.json and/or metrics.jsonl)."""
    run = Path(run)
    eval_file, metrics_file = run / "eval.json", run / "metrics.jsonl"
    if not eval_file.is_file() and not metrics_file.is_file():
        raise FileNotFoundError(f"{run} holds neither eval.json nor metrics.jsonl: pass an eval or PPO run dir")
    rows = eval_rows(run, json.loads(eval_file.read_text(encoding="utf-8"))) if eval_file.is_file() else []
    return rows + (ppo_rows(run) if metrics_file.is_file() else [])


def run_tags(run: Path) -> set[str]:
    """Env tags with results in one run directory."""
    tags = set()
    if (run / "eval.json").is_file():
        tags |= set(json.loads((run / "eval.json").read_text(encoding="utf-8")).get("metrics", {}))
    if (run / "metrics.jsonl").is_file():
        tags |= set(read_metrics_jsonl(run / "metrics.jsonl"))
    return tags


def run_envs(runs: Iterable[Path]) -> list[str]:
    """The paper environments our runs cover (all three when none is recognized)."""
    found = {TAG_TO_ENV.get(tag) for run in runs for tag in run_tags(Path(run))}
    return [env for env in ENVS if env in found] or list(ENVS)


def paper_table(models: list[str], envs: list[str]) -> str:
    """The paper's Pass@1 / Pass@8 for `models` and `envs`, labelled as reported numbers."""
    lines = [f"### Paper reference: {SOURCE}", "",
             "| model | method | " + " | ".join(f"{e} P@1 | {e} P@8" for e in envs) + " |",
             "|---|---|" + "---|---|" * len(envs)]
    for model in models:
        for method, values in MAIN_RESULTS[model].items():
            cells = " | ".join(f"{values[e][0]:.1f} | {values[e][1]:.1f}" for e in envs)
            lines.append(f"| {model} | {method} | {cells} |")
    return "\n".join(lines)


def build_report(runs: list[Path], paper_models: list[str] | None = None) -> str:
    """The whole markdown report."""
    unknown = [m for m in paper_models or [] if m not in MAIN_RESULTS]
    if unknown:
        raise ValueError(f"unknown paper model(s) {unknown}; choose from {sorted(MAIN_RESULTS)}")
    rows = [row for run in runs for row in run_rows(run)]
    models = paper_models or ["Qwen2.5-1.5B-Instruct"]
    return "\n".join([
        "## Our results (measured)", "",
        ("Pass@1 = mean success; any-of-n = the original `pass@<G>` metric (any of the n samples solved the "
         "puzzle); unbiased pass@k = 1 − C(n−c,k)/C(n,k) averaged over puzzles, with a bootstrap 95% interval."), "",
        HEADER, *rows, "", paper_table(models, run_envs(runs)), "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Markdown table of our runs beside the paper's numbers.")
    parser.add_argument("runs", nargs="+", type=Path, help="evaluation or PPO run directories")
    parser.add_argument("--paper-model", action="append", default=None,
                        help=f"paper model rows to show (repeatable; default Qwen2.5-1.5B-Instruct). "
                             f"One of: {', '.join(MAIN_RESULTS)}; model_size aliases: {MODEL_SIZE_TO_PAPER}")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    try:
        models = [MODEL_SIZE_TO_PAPER.get(m, m) for m in args.paper_model] if args.paper_model else None
        report = build_report(args.runs, models)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out:
        try:
            atomic_io.write_text(args.out, report)
        except OSError as err:
            print(f"error: cannot write {args.out}: {err.strerror or err}; choose a writable --out", file=sys.stderr)
            return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reports of our runs, in markdown: the one reporting module.

- `build_report`: one row per run and env tag, beside the paper's reference numbers (the command line is
  `python -m SPA_agent.report`, SPA_agent/report.py).
- `write_arms_report`: PPO runs side by side (issue 13's arms, `python -m SPA_agent.spa_arms report`): validation
  success with 95% intervals per step, world-model accuracy after SFT and after PPO, actor entropy.

A run directory is an evaluation (eval.json, from `SPA_agent.evaluate`) or a PPO run (metrics.jsonl with
`val-env/<Tag>/success` and `val-env/<Tag>/pass@<G>`; its final and best validation steps are reported).
Numbers are percentages, as in the paper. Runs of a named experiment (`experiment=<name>`, config/experiment/)
are labelled with its name and the paper row it corresponds to, with the paper's numbers for that row, model
and env where the paper reports them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import OmegaConf

from SPA_agent.evaluation.learning_curves import Curve, CurvePoint, intervals_overlap, load_curve
from SPA_agent.evaluation.paper_results import (
    ENVS,
    MAIN_RESULTS,
    MODEL_SIZE_TO_PAPER,
    SOURCE,
    TAG_TO_ENV,
    paper_numbers,
)
from SPA_agent.evaluation.plots import plot_arms, read_metrics_jsonl
from SPA_agent.runs import atomic_io
from SPA_agent.runs.run_identity import git_commit

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


# --- PPO runs side by side ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Arm:
    """One run of a side-by-side report: its label, its PPO run directory and the add_worldmodel evaluations
    (eval.json contents, None where absent) of the checkpoint it started from (`sft`) and of its last actor (`ppo`)."""

    label: str
    ppo_dir: Path
    worldmodel_evals: Mapping[str, Mapping | None]


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _point(p: CurvePoint | None) -> str:
    return "–" if p is None else f"{p.success:.3f} [{p.low:.3f}, {p.high:.3f}]"


def worldmodel_exact(result: Mapping | None) -> dict[str, float | int | None]:
    """Format rate (turns with state blocks) and, over those turns, observation and prediction exact match of an
    add_worldmodel evaluation (its single env tag), and the training step of the checkpoint evaluated; None where
    absent."""
    metrics = next(iter(result["metrics"].values())) if result else {}
    step = re.search(r"global_step_(\d+)", result["model_path"]) if result else None
    return {**{name: metrics.get(f"worldmodel/{key}") for name, key in (
        ("format", "format_rate"), ("observation", "observation_exact"), ("prediction", "prediction_exact"))},
            "step": int(step.group(1)) if step else None}


def worldmodel_cell(wm: Mapping[str, float | int | None], with_step: bool = False) -> str:
    """A `worldmodel_exact` result in one table cell."""
    if wm["format"] is None:
        return "–"
    at = f", step {wm['step']}" if with_step and wm["step"] is not None else ""
    return f"obs {_fmt(wm['observation'])} / pred {_fmt(wm['prediction'])} (format {_fmt(wm['format'])}{at})"


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _commit() -> str:
    """The checkout's commit; SPA_AGENT_COMMIT names it where the code was copied without its git history."""
    commit = git_commit()
    return commit[:7] if commit else os.environ.get("SPA_AGENT_COMMIT", "unknown")


def arm_curves(arms: Mapping[str, Arm]) -> dict[str, Curve]:
    """The learning curves of the arms whose PPO run has logged (metrics.jsonl and config.yaml), by arm name."""
    return {name: load_curve(arm.ppo_dir) for name, arm in arms.items()
            if (arm.ppo_dir / "metrics.jsonl").is_file() and (arm.ppo_dir / "config.yaml").is_file()}


def _arm_row(arm: Arm, curve: Curve | None) -> tuple[str, dict]:
    """The summary table's row of one arm and its report.json entry."""
    points = {p.step: p for p in curve.points} if curve else {}
    init, final = points.get(0), points[max(points)] if points else None
    wm = {which: worldmodel_exact(arm.worldmodel_evals.get(which)) for which in ("sft", "ppo")}
    entropy = curve.entropy if curve else []
    change = None if init is None or final is None or final.step == 0 else 100 * (final.success - init.success)
    overlap = "–" if change is None else ("yes" if intervals_overlap(init, final) else "no")
    row = (f"| {arm.label} | {_point(init)} | {_point(final)} (step {final.step if final else '–'}) | "
           f"{_fmt(change, 1)} | {overlap} | {worldmodel_cell(wm['sft'])} | {worldmodel_cell(wm['ppo'], with_step=True)} | "
           f"{_fmt(entropy[0][1] if entropy else None)} → {_fmt(entropy[-1][1] if entropy else None)} |")
    data = {"label": arm.label, "episodes": curve.episodes if curve else None,
            "validation": [asdict(p) for p in curve.points] if curve else [], "entropy": entropy, "worldmodel": wm}
    return row, data


def write_arms_report(out: Path, arms: Mapping[str, Arm], curves: Mapping[str, Curve], title: str, setup: str,
                      settings: Mapping) -> Path:
    """out/{report.md, report.json, arms.png}: the arms side by side from what their runs have logged so far
    (`curves`, from `arm_curves`). `title` heads report.md; `setup` ends its line on device, commit and
    validation episodes; `settings` are written into both files."""
    summary, data = [], {}
    for name, arm in arms.items():
        summary_row, data[name] = _arm_row(arm, curves.get(name))
        summary.append(summary_row)
    steps = sorted({p.step for c in curves.values() for p in c.points})
    per_step = [f"| {step} | " + " | ".join(_point(next((p for p in curves[a].points if p.step == step), None))
                                           if a in curves else "–" for a in arms) + " |" for step in steps]
    episodes = sorted({c.episodes for c in curves.values()})
    device, commit = _device(), _commit()
    lines = [
        f"# {title}", "",
        f"Device: {device}; commit {commit}; validation: {'/'.join(map(str, episodes))} episodes per point {setup}", "",
        "| arm | SFT init success (step 0) | final success | change (points) | intervals overlap | "
        "world model after SFT | world model after PPO | actor entropy (first → last step) |",
        "|---|---|---|---|---|---|---|---|", *summary, "",
        "World model: exact match of `<observation>` and `<prediction>` with the true states, over the turns that "
        "wrote them; format = fraction of turns that did; after PPO: the last saved actor, at the step named.", "",
        "Validation success [95% interval] per PPO step:", "",
        "| step | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|", *per_step, "",
        f"Settings: `{json.dumps(settings)}`", ""]
    out.mkdir(parents=True, exist_ok=True)
    plot_arms({name: curves[name] for name in arms if name in curves}, out / "arms.png")
    atomic_io.write_json(out / "report.json", {"device": device, "commit": commit, "settings": settings,
                                               "arms": data})
    atomic_io.write_text(out / "report.md", "\n".join(lines))
    return out / "report.md"

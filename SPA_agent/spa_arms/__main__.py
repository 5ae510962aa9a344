"""Issue 13's SPA experiment at small scale: three arms from the same self-play data, SFT, then PPO side by side.

    python -m SPA_agent.spa_arms all --out arms          # every stage below, in order
    python -m SPA_agent.spa_arms status --out arms       # one line per stage and arm (for polling a background run)
    python -m SPA_agent.spa_arms all --out arms_grpo --from arms --ppo-overrides "algorithm.adv_estimator=grpo"
                                                          # PPO again from the SFT checkpoints of arms

Arms: `spa` (a: world-model SFT, loss_target=paper), `nowm` (b: the same trajectories without <observation>/
<prediction>, base prompts, loss_target=paper), `released` (c: loss_target=released). Stages, each skipping what is
complete and continuing what was interrupted (SFT and PPO from their last checkpoint, data per batch):

  data    self-play data with the random generator in add_worldmodel mode (DIR/data), and the same rows without
          world model (DIR/data_nowm, SPA_agent.selfplay.data_variants.without_worldmodel_row; its data card comes last)
  sft     one SFT run per arm, in parallel processes -> DIR/sft/<arm>, then DIR/sft/<arm>.json (the checkpoint)
  wm      world-model accuracy (SPA_agent.evaluate, add_worldmodel prompts) of each SFT checkpoint and of each
          PPO run's last saved actor, finished or not -> DIR/eval/<arm>/{sft,ppo}/eval.json
  ppo     PPO from each arm's SFT checkpoint, the arms as parallel processes on one device -> DIR/ppo/<arm>;
          validation at step 0 (the SFT init) and every --test-freq steps, checkpoints every --save-freq steps
  report  DIR/report/{report.md, report.json, arms.png}: validation success with 95% bootstrap intervals over
          episodes per step and arm, world-model accuracy after SFT and after PPO, actor entropy
  all     data, sft, then ppo with the SFT checkpoints' wm evaluations beside it, then wm, report

Every process logs to DIR/logs/<job>.log (with <job>.pid while it runs and <job>.rc when it ended). The settings
are recorded in DIR/settings.json by the first run; a later run with other settings is refused, except
--ppo-steps, which may grow (the PPO runs continue), --arms, --max-parallel and --devices (comma-separated GPU
ids that a stage's processes are spread over, round-robin; default: all on the default device). Extra overrides:
--overrides (data, PPO and evaluation: the env and rollout settings), --data-overrides, --sft-overrides,
--ppo-overrides, --eval-overrides (each one quoted string, split like a shell line).

--from DIR starts a new experiment from the data and SFT checkpoints of the experiment DIR: its data, data_nowm and
sft are linked into --out (relative symbolic links: the two directories may be moved or copied side by side), so
the data and sft stages find them complete and only PPO, the evaluations and the report run. The new experiment
starts from DIR's settings; options given replace them, except those its data and SFT were made with (--config,
--model, --data-batches, --sft-*, --overrides, --data-overrides), which a different value refuses. DIR's data and
SFT must be complete for every arm run, and --out must not have data or SFT of its own. Like the other settings,
--from is recorded in settings.json (as from_dir, relative to --out) and cannot change later.
"""


from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, fields
from pathlib import Path

from SPA_agent.pipeline_check import check_commands
from SPA_agent.runs import atomic_io
from SPA_agent.spa_arms.experiment import Experiment
from SPA_agent.spa_arms.settings import ARMS, HELP, Settings, StageError, check_settings, load_settings
from SPA_agent.spa_arms.status import status_lines, write_report

#: command-line flags that are not the field name with dashes (`from` is a Python keyword)
FLAGS = {"from_dir": "--from"}


def stage_report(exp: Experiment) -> None:
    print(f"report written to {write_report(exp)}", flush=True)


def stage_all(exp: Experiment) -> None:
    """data, sft; then PPO with the SFT checkpoints' evaluations beside it; the PPO actors' evaluations; the
    report. A failed evaluation or PPO arm does not stop the others; the stage fails at the end."""
    exp.stage_data()
    exp.stage_sft()
    errors = []
    for step in (exp.stage_ppo_beside_evaluations, exp.stage_wm, lambda: stage_report(exp)):
        try:
            step()
        except StageError as err:
            errors.append(str(err))
    if errors:
        raise StageError("; ".join(errors))


STAGES = {"data": Experiment.stage_data, "sft": Experiment.stage_sft, "wm": Experiment.stage_wm,
          "ppo": Experiment.stage_ppo, "report": stage_report, "all": stage_all}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m SPA_agent.spa_arms", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=[*STAGES, "status"])
    parser.add_argument("--out", type=Path, required=True, help="experiment directory")
    defaults = Settings()
    for f in fields(Settings):
        flag = FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
        help_text = f"{HELP[f.name]} (default: {getattr(defaults, f.name)!r})"
        if f.name == "arms":
            parser.add_argument(flag, nargs="+", choices=list(ARMS), default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=type(getattr(defaults, f.name)), default=None,
                                help=help_text)
    return parser.parse_args(argv)


def check_started(out: Path) -> None:
    """`status` polls an experiment that a run has started (its settings.json is written first); a mistyped --out
    would otherwise show every stage "not started"."""
    if not (out / "settings.json").is_file():
        reason = "holds no spa_arms experiment (no settings.json)" if out.exists() else "does not exist"
        raise StageError(f"{out} {reason}; start one with python -m SPA_agent.spa_arms all --out {out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in fields(Settings)}
    if given["arms"] is not None:
        given["arms"] = tuple(given["arms"])
    if given["from_dir"]:  # recorded relative to --out, like the links
        given["from_dir"] = os.path.relpath(Path(given["from_dir"]).resolve(), args.out.resolve())
    try:
        if args.stage == "status":
            check_started(args.out)
        settings = load_settings(args.out, given)
        exp = Experiment(args.out, settings)
        if args.stage == "status":
            print("\n".join(status_lines(exp)))
            return 0
        if args.stage != "report":  # every stage's settings, before the first one starts or anything is written
            check_settings(settings)
            check_commands(exp.planned_commands())
        exp.link_source()
        exp.out.mkdir(parents=True, exist_ok=True)
        atomic_io.write_json(exp.out / "settings.json", asdict(settings))
        STAGES[args.stage](exp)
    except (StageError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The pipeline's stages, written once: their order, the files and folders that pass between them, and the one
function per stage that builds its command line.

    stage       entry point                  reads                                writes
    data        SPA_agent.generate_sft_data  a model                              DATA_DIR/wm_{train,val}.parquet,
                                                                                  DATA_DIR/data_card.json (last)
    sft         sft.spa_sft_trainer          DATA_DIR/wm_{train,val}.parquet      SFT_DIR/global_step_N
    ppo         SPA_agent.trainer.main_ppo   a model (SFT_DIR/global_step_N)      RUN_DIR/global_step_N/actor
    evaluation  SPA_agent.evaluate           a model                              EVAL_DIR/{before_ppo,after_ppo}
    report      SPA_agent.report             EVAL_DIR/{before_ppo,after_ppo}, RUN_DIR  EVAL_DIR/summary.md

A command is what follows `python`: `["-m", <entry point>, ...]` with the stage's own settings first, then the
caller's, then the user's Hydra overrides, so that later ones win. The bash scripts (run_spa.sh, run_baseline.sh,
train_ppo_sfted.sh, sft/finetune_ft.sh) print theirs with `python -m SPA_agent.stages <stage> ...` (one argument a
line, as scripts/common.sh `run_stage` and `check_stages` read them); the three-arm study (SPA_agent/spa_arms) and
the in-process SFT of tests and benchmarks (sft/in_process.py) call the functions. The model-size table (`MODEL`
name -> preset, SFT model, per-model defaults) is SPA_agent/model_presets.py; the stages read it from there.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath

#: the entry configs (config/<name>.yaml)
CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"

# ---------------------------------------------------------------------------------------------- the stages


@dataclass(frozen=True)
class Stage:
    """One stage: its name, entry-point module and how messages call it."""

    name: str
    module: str
    title: str


#: the stages in the order a pipeline runs them
STAGES = (
    Stage("data", "SPA_agent.generate_sft_data", "stage 1 (self-play data)"),
    Stage("sft", "sft.spa_sft_trainer", "stage 2 (SFT)"),
    Stage("ppo", "SPA_agent.trainer.main_ppo", "PPO"),
    Stage("evaluation", "SPA_agent.evaluate", "evaluation"),
    Stage("report", "SPA_agent.report", "report"),
)
MODULES = {stage.name: stage.module for stage in STAGES}
#: stage 2's config check, which SPA_agent.pipeline_check runs by this name before a pipeline starts: SPA_agent
#: imports nothing from sft, whose entry point it also knows only by name
SFT_CONFIG_CHECK = "sft.config_checks:check_sft_config"

# ------------------------------------------------------------------------------- files between the stages

#: the data stage's splits, DATA_DIR/<split>.parquet, which SFT trains and validates on
SPLITS = ("wm_train", "wm_val")
TRAIN_FILE, VAL_FILE = DATA_FILES = tuple(f"{split}.parquet" for split in SPLITS)
#: written last by the data stage: its presence marks a complete dataset (SPA_agent/selfplay/data_card.py)
CARD_FILE = "data_card.json"
#: the scripts' two evaluations in EVAL_DIR: the model PPO starts from, and the PPO run's final actor
EVALUATIONS = ("before_ppo", "after_ppo")
#: the report of those two beside the paper's rows, in EVAL_DIR
SUMMARY_FILE = "summary.md"
#: PYTHONHASHSEED of every stage process (the original pipeline's)
HASH_SEED = "10000"


def data_file(data_dir: str | Path, name: str) -> str:
    """`<data_dir>/<name>` as written (a relative `./` kept), the way the stages' overrides name it."""
    return f"{data_dir}/{name}"


def data_dir(config: str, model: str, render_mode: str, suffix: str = "") -> str:
    """The scripts' default data directory (run_spa.sh OUTPUT_DIR): `suffix` is the experiment's data id."""
    return f"./sftdata/{config}-{model}-{render_mode}{suffix}"


def sft_dir(config: str, model: str, render_mode: str, family: str, suffix: str = "") -> str:
    """The scripts' default SFT directory (run_spa.sh CHECKPOINT_DIR): `family` is the table's, `suffix` the
    experiment's SFT id."""
    return f"./sftckpt/checkpoints{config}-{model}-{render_mode}-{family}{suffix}"


def ppo_experiment_name(config: str, model: str, render_mode: str, experiment: str, start: str | None = None) -> str:
    """The PPO run's name: run_spa.sh ends it with the SFT checkpoint's folder (`start`), run_baseline.sh not."""
    name = f"{config}-{model}-{render_mode}-{experiment}"
    return f"{name}-{PurePath(start).name}" if start else name


def ppo_run_dir(base_dir: str, config: str, experiment_name: str) -> str:
    """RUN_DIR of a PPO run under BASE_DIR."""
    return f"{base_dir}/{config}/{experiment_name}"


def eval_dir(experiment_name: str) -> str:
    """The scripts' default EVAL_DIR of a PPO run."""
    return f"./evals/{experiment_name}"


# --------------------------------------------------------------------------------------- command lines

#: the original finetune_ft.sh's recipe (spec §2.4): equal to sft/config/sft_trainer.yaml's defaults but for the two
#: checkpoints kept; the scripts pass it, so that the recipe does not change with that file
PAPER_SFT = ("data.prompt_key=prompt", "data.response_key=response", "optim.lr=1e-4", "data.train_batch_size=16",
             "data.micro_batch_size_per_gpu=1", "trainer.logger=['console']", "trainer.total_epochs=5",
             "trainer.max_ckpt_to_keep=2", "model.target_modules=all-linear", "trainer.project_name=spa-sft",
             "model.enable_gradient_checkpointing=False")


def data_command(config: str, model: str, output_dir: str | Path, *, generator: str, batches: int | None = None,
                 resume: bool | None = None, settings: Sequence[str] = (), overrides: Sequence[str] = ()) -> list[str]:
    """Stage 1: `batches` rollout batches of self-play data with `generator` into `output_dir`, continuing a matching
    unfinished run there when `resume` (None: config/data_gen.yaml's value of each)."""
    batches_setting = [] if batches is None else [f"data_gen.num_batches={batches}"]
    resume_setting = [] if resume is None else [f"data_gen.resume={str(resume).lower()}"]
    return ["-m", MODULES["data"], "--config-name", config, f"model={model}", *settings, f"generator={generator}",
            *batches_setting, f"data_gen.output_dir={output_dir}", *resume_setting, *overrides]


def sft_overrides(data_dir: str | Path, save_dir: str | Path, model: str, *, settings: Sequence[str] = (),
                  overrides: Sequence[str] = ()) -> list[str]:
    """Stage 2's Hydra overrides: train `model` on `data_dir`'s splits into `save_dir`."""
    return [f"data.train_files={data_file(data_dir, TRAIN_FILE)}", f"data.val_files={data_file(data_dir, VAL_FILE)}",
            f"model.partial_pretrain={model}", f"trainer.default_local_dir={save_dir}", *settings, *overrides]


def sft_command(data_dir: str | Path, save_dir: str | Path, model: str, *, settings: Sequence[str] = (),
                overrides: Sequence[str] = ()) -> list[str]:
    """Stage 2, the command of one rank (sft/finetune_ft.sh launches it over torchrun): see `sft_overrides`."""
    return ["-m", MODULES["sft"], *sft_overrides(data_dir, save_dir, model, settings=settings, overrides=overrides)]


def ppo_command(config: str, model: str, model_path: str | Path, run_dir: str | Path, *, name: str, steps: int,
                save_freq: int, resume_mode: str, settings: Sequence[str] = (),
                overrides: Sequence[str] = ()) -> list[str]:
    """Stage 3: `steps` PPO steps from `model_path` (preset `model`) into `run_dir` (`resume_mode`: auto or disable)."""
    return ["-m", MODULES["ppo"], "--config-name", config, f"model={model}", f"model_path={model_path}", *settings,
            f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq}",
            f"trainer.experiment_name={name}", f"trainer.resume_mode={resume_mode}",
            f"trainer.default_local_dir={run_dir}", *overrides]


def backend_settings(ngpus: int, rollout_tp: str = "auto") -> list[str]:
    """The scripts' PPO backend: one process for CPU or one GPU (local); verl's Ray/FSDP workers with
    tensor-parallel vLLM beyond."""
    backend = ["trainer.backend=local"]
    if ngpus > 1:
        backend = ["trainer.backend=verl", f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}"]
    return [*backend, f"trainer.n_gpus_per_node={max(ngpus, 1)}"]


def evaluation_command(config: str, model: str, model_path: str | Path, output_dir: str | Path, *,
                       settings: Sequence[str] = (), overrides: Sequence[str] = ()) -> list[str]:
    """An evaluation of `model_path` (preset `model`) into `output_dir`, replacing one there."""
    return ["-m", MODULES["evaluation"], "--config-name", config, f"model={model}", f"model_path={model_path}",
            *settings, f"evaluation.output_dir={output_dir}", "evaluation.overwrite=true", *overrides]


def report_command(eval_dir: str, run_dir: str, paper_model: str | None = None) -> list[str]:
    """The summary of EVAL_DIR's two evaluations and the PPO run, beside the paper's rows of `paper_model`."""
    before, after = (f"{eval_dir}/{which}" for which in EVALUATIONS)
    paper = ["--paper-model", paper_model] if paper_model else []
    return ["-m", MODULES["report"], before, after, run_dir, *paper, "--out", f"{eval_dir}/{SUMMARY_FILE}"]


# ----------------------------------------------------------------------------------- the scripts' side


def script_names(config: str, model_size: str, render_mode: str, experiment: str, base_dir: str,
                 start: str | None = None, data_suffix: str = "", sft_suffix: str = "") -> dict[str, str]:
    """The folders of a script's run (run_spa.sh, run_baseline.sh): the default data and SFT directories, and the
    PPO run's name, directory and default evaluation directory (`start`: the SFT checkpoint, for run_spa.sh)."""
    from SPA_agent.model_presets import script_model

    name = ppo_experiment_name(config, model_size, render_mode, experiment, start)
    return {"DEFAULT_OUTPUT_DIR": data_dir(config, model_size, render_mode, data_suffix),
            "DEFAULT_CHECKPOINT_DIR": sft_dir(config, model_size, render_mode, script_model(model_size).family,
                                              sft_suffix),
            "EXPERIMENT_NAME": name, "RUN_DIR": ppo_run_dir(base_dir, config, name), "DEFAULT_EVAL_DIR": eval_dir(name)}


def script_sft_command(env_type: str, save_dir: str, data_dir: str, model_size: str, resume: str,
                       overrides: Sequence[str] = ()) -> list[str]:
    """sft/finetune_ft.sh's stage: the paper's recipe with the table's model, family and length for `model_size`;
    an `env_type` naming an entry config is checked against the data card (other data is refused)."""
    from SPA_agent.model_presets import script_model

    row = script_model(model_size, "model size")
    card_check = [f"data.config_name={env_type}"] if (CONFIG_DIR / f"{env_type}.yaml").is_file() else []
    name = f"{env_type}-sft-{row.sft_family}-{model_size}-instruct"
    return sft_command(data_dir, save_dir, row.sft_model(), overrides=[*card_check, *overrides], settings=[
        f"data.max_length={row.sft_max_length}", f"trainer.experiment_name={name}", f"trainer.resume={resume}",
        *PAPER_SFT])


#: train_ppo_sfted.sh's checkpoint interval (PPO steps)
SCRIPT_PPO_SAVE_FREQ = 100


class ScriptError(ValueError):
    """A script's argument that no stage can run with: one line."""


def check_sft_arguments(nproc: str, data_dir: str | None) -> None:
    """sft/finetune_ft.sh's <nproc_per_node> and, unless None, <data_path> (which must hold the splits)."""
    if not re.fullmatch(r"[1-9][0-9]*", nproc):
        raise ScriptError(f"nproc_per_node must be a positive integer, got '{nproc}'")
    for name in DATA_FILES if data_dir is not None else ():
        if not Path(data_file(data_dir, name)).is_file():
            raise ScriptError(f"{data_file(data_dir, name)} not found: run stage 1 first or fix <data_path>")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m SPA_agent.stages", description="A stage's command line (one "
                                     "argument a line) or a script's folders (shell assignments); Hydra overrides "
                                     "after --.")
    sub = parser.add_subparsers(dest="stage", required=True)
    data = sub.add_parser("data", help="stage 1: self-play data")
    for flag in ("--config", "--model", "--generator", "--output-dir"):
        data.add_argument(flag, required=True)
    data.add_argument("--render-mode", help="default: the config's")
    data.add_argument("--batches", type=int, help="default: the config's")
    data.add_argument("--resume", choices=("true", "false"), help="default: the config's")
    sft = sub.add_parser("sft", help="stage 2: world-model SFT (sft/finetune_ft.sh)")
    for flag in ("--env-type", "--save-dir", "--data-dir", "--model-size"):
        sft.add_argument(flag, required=True)
    sft.add_argument("--resume", choices=("auto", "disable"), required=True)
    sft.add_argument("--nproc", required=True, help="ranks, checked to be a positive integer")
    sft.add_argument("--check-data", action="store_true", help="refuse a --data-dir without the data stage's splits")
    ppo = sub.add_parser("ppo", help="stage 3: PPO (train_ppo_sfted.sh)")
    for flag in ("--config", "--model", "--model-path", "--base-dir", "--name", "--render-mode"):
        ppo.add_argument(flag, required=flag != "--render-mode")
    ppo.add_argument("--steps", type=int, required=True)
    ppo.add_argument("--resume-mode", choices=("auto", "disable"), required=True)
    ppo.add_argument("--ngpus", type=int, required=True)
    ppo.add_argument("--rollout-tp", default="auto")
    evaluation = sub.add_parser("evaluation", help="an evaluation (scripts/common.sh evaluate_before_after)")
    for flag in ("--config", "--model-size", "--model-path", "--output-dir", "--render-mode", "--generator"):
        evaluation.add_argument(flag, required=True)
    report = sub.add_parser("report", help="the summary of the two evaluations (evaluate_before_after)")
    for flag in ("--eval-dir", "--run-dir", "--model-size"):
        report.add_argument(flag, required=True)
    names = sub.add_parser("names", help="shell assignments: a script's folders (script_names)")
    for flag in ("--config", "--model-size", "--render-mode", "--experiment", "--base-dir"):
        names.add_argument(flag, required=True)
    for flag in ("--start", "--data-suffix", "--sft-suffix"):
        names.add_argument(flag, default="")
    return parser


def _render(mode: str | None) -> list[str]:
    """`render_mode=<mode>` when a mode is given; none lets the config (and an experiment=<name>) decide."""
    return [f"render_mode={mode}"] if mode else []


def _data(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    resume = None if args.resume is None else args.resume == "true"
    return data_command(args.config, args.model, args.output_dir, generator=args.generator, batches=args.batches,
                        resume=resume, settings=_render(args.render_mode), overrides=overrides)


def _sft(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    command = script_sft_command(args.env_type, args.save_dir, args.data_dir, args.model_size, args.resume, overrides)
    check_sft_arguments(args.nproc, args.data_dir if args.check_data else None)
    return command


def _ppo(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    return ppo_command(args.config, args.model, args.model_path, ppo_run_dir(args.base_dir, args.config, args.name),
                       name=args.name, steps=args.steps, save_freq=SCRIPT_PPO_SAVE_FREQ, resume_mode=args.resume_mode,
                       settings=[*_render(args.render_mode), *backend_settings(args.ngpus, args.rollout_tp)],
                       overrides=overrides)


def _evaluation(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    from SPA_agent.model_presets import script_model

    return evaluation_command(args.config, script_model(args.model_size).preset, args.model_path, args.output_dir,
                              settings=[*_render(args.render_mode), f"generator={args.generator}"],
                              overrides=overrides)


def _report(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    from SPA_agent.model_presets import script_model

    return report_command(args.eval_dir, args.run_dir, args.model_size if script_model(args.model_size).in_paper
                          else None)


#: the scripts' command of each stage, from the parsed flags and the Hydra overrides after --
SCRIPT_COMMANDS = {"data": _data, "sft": _sft, "ppo": _ppo, "evaluation": _evaluation, "report": _report}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:split])
    overrides = argv[split + 1:]
    from SPA_agent.model_presets import UnknownModelError

    try:
        if args.stage == "names":
            values = script_names(args.config, args.model_size, args.render_mode, args.experiment, args.base_dir,
                                  args.start or None, args.data_suffix, args.sft_suffix)
            print("\n".join(f"{key}={shlex.quote(value)}" for key, value in values.items()))
        else:
            print("\n".join(SCRIPT_COMMANDS[args.stage](args, overrides)))
    except (UnknownModelError, ScriptError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

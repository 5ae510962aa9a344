"""The paper's experiment matrix as named experiments: `config/experiment/<name>.yaml`, chosen with
`experiment=<name>` on any entry point or pipeline script.

    python -m SPA_agent.experiments list                      # name, kind, paper row, description, command
    python -m SPA_agent.experiments show self_belief_sft      # its metadata and config overrides
    bash run_spa.sh _2_sokoban last True experiment=self_belief_sft
    bash run_baseline.sh _2_sokoban experiment=state_estimation_rl

Each file sets ordinary config keys (render_mode, data_gen.*, algorithm.*, es_manager.val.*) plus an
`experiment_info` block read here: the paper row, which script runs it, the MODEL and data generator it
implies, SFT overrides, and the ids that name its data and SFT directories. `settings` turns that block into
shell assignments for run_spa.sh and run_baseline.sh (checked, one-line errors).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from SPA_agent.config import CONFIG_DIR, close_matches, compose
from SPA_agent.entry import EXIT_USAGE, USER_ERRORS

EXPERIMENT_DIR = CONFIG_DIR / "experiment"
KINDS = ("main", "data", "sft", "rl", "eval")
PIPELINES = {"spa": "run_spa.sh", "baseline": "run_baseline.sh"}
#: experiment each script runs when none is named, by render mode (RENDER_MODE keeps its old meaning)
DEFAULT_EXPERIMENT = {
    ("spa", "text_with_coordinates"): "spa", ("spa", "text"): "spa_no_state_estimation",
    ("baseline", "text"): "vanilla_rl", ("baseline", "text_with_coordinates"): "state_estimation_rl",
}
#: render mode of each script when neither RENDER_MODE nor an experiment sets one
DEFAULT_RENDER = {"spa": "text_with_coordinates", "baseline": "text"}


@dataclass(frozen=True)
class Experiment:
    """The `experiment_info` block of one experiment config."""

    name: str
    description: str
    kind: str
    paper: str
    pipeline: str
    configs: list[str] = field(default_factory=list)
    model: str | None = None
    data_generator: str | None = None
    data_id: str = "spa"
    sft_id: str = "spa"
    sft_overrides: list[str] = field(default_factory=list)

    def command(self, config_name: str | None = None) -> str:
        config_name = config_name or (self.configs[0] if len(self.configs) == 1 else "<config>")
        if self.pipeline == "baseline":
            return f"bash run_baseline.sh {config_name} experiment={self.name}"
        return f"bash run_spa.sh {config_name} last True experiment={self.name}"


def names() -> list[str]:
    """Every experiment, by file name."""
    return sorted(p.stem for p in EXPERIMENT_DIR.glob("*.yaml"))


def load(name: str) -> Experiment:
    """The metadata of experiment `name` (read from its file, no composition)."""
    path = EXPERIMENT_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown experiment {name!r}{close_matches(name, names())}; choose one of "
                         f"{', '.join(names())} (python -m SPA_agent.experiments list)")
    info = OmegaConf.to_container(OmegaConf.load(path).experiment_info)
    return Experiment(**info)


def selected(overrides: Sequence[str]) -> str | None:
    """The experiment named by the last `experiment=<name>` override, if any."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")]
    return chosen[-1] if chosen else None


def settings(pipeline: str, config_name: str, overrides: Sequence[str], render_env: str = "") -> dict[str, str]:
    """Shell variables for a pipeline script: EXPERIMENT, EXP_ARGS (the override to add when none was given),
    EXP_RENDER_MODE, EXP_MODEL, EXP_DATA_GENERATOR, EXP_DATA_SUFFIX, EXP_SFT_SUFFIX, EXP_SFT_OVERRIDES.
    Composes the config with the overrides, so a bad override or experiment fails here, in one line."""
    name, extra = selected(overrides), []
    if name is None:
        name = DEFAULT_EXPERIMENT.get((pipeline, render_env or DEFAULT_RENDER[pipeline]))
        if name is None:
            raise ValueError(f"unknown RENDER_MODE {render_env!r}; choose text or text_with_coordinates")
        extra = [f"experiment={name}"]
    exp = load(name)
    if exp.pipeline != pipeline:
        raise ValueError(f"experiment {name} runs with {PIPELINES[exp.pipeline]}: {exp.command(config_name)}")
    if exp.configs and config_name not in exp.configs:
        raise ValueError(f"experiment {name} applies to {', '.join(exp.configs)}, not {config_name}")
    cfg = compose(config_name, [*overrides, *extra])
    if render_env and render_env != cfg.render_mode:
        raise ValueError(f"RENDER_MODE={render_env} contradicts experiment {name} (render_mode={cfg.render_mode}); "
                         "unset RENDER_MODE or pick another experiment")
    return {
        "EXPERIMENT": name, "EXP_ARGS": " ".join(extra), "EXP_RENDER_MODE": cfg.render_mode,
        "EXP_MODEL": exp.model or "", "EXP_DATA_GENERATOR": exp.data_generator or "",
        "EXP_DATA_SUFFIX": "" if exp.data_id == "spa" else f"-{exp.data_id}",
        "EXP_SFT_SUFFIX": "" if exp.sft_id == "spa" else f"-{exp.sft_id}",
        "EXP_SFT_OVERRIDES": " ".join(exp.sft_overrides),
    }


def list_table() -> str:
    """Markdown table of every experiment."""
    lines = ["| experiment | kind | paper row | description | command |", "|---|---|---|---|---|"]
    for exp in sorted(map(load, names()), key=lambda e: (KINDS.index(e.kind), e.name)):
        scope = f" ({', '.join(exp.configs)} only)" if exp.configs else ""
        lines.append(f"| `{exp.name}` | {exp.kind} | {exp.paper} | {exp.description}{scope} | `{exp.command()}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The paper's experiments as named configs (experiment=<name>).")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every experiment with its kind, paper row, description and command")
    show = sub.add_parser("show", help="one experiment's metadata and config overrides")
    show.add_argument("name")
    shell = sub.add_parser("settings", help="shell assignments for run_spa.sh / run_baseline.sh")
    shell.add_argument("pipeline", choices=sorted(PIPELINES))
    shell.add_argument("config_name")
    shell.add_argument("--render-mode", default="", help="RENDER_MODE of the environment, if set")
    shell.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print(list_table())
        elif args.command == "show":
            load(args.name)
            print((EXPERIMENT_DIR / f"{args.name}.yaml").read_text(encoding="utf-8"))
        else:
            values = settings(args.pipeline, args.config_name, args.overrides, args.render_mode)
            print("\n".join(f"{key}={shlex.quote(value)}" for key, value in values.items()))
    except (*USER_ERRORS, ConfigCompositionException, OmegaConfBaseException) as err:
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())

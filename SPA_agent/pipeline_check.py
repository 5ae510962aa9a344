"""Every stage's settings, checked before the first stage of a pipeline runs.

    python -m SPA_agent.pipeline_check -m SPA_agent.generate_sft_data --config-name _2_sokoban model=tiny ... \
        --then -m sft.spa_sft_trainer data.train_files=... --then -m SPA_agent.trainer.main_ppo --config-name ...

Takes the commands a pipeline is about to run (the python arguments of each stage, separated by `--then`), composes
each one's config as its entry point would and runs that stage's own checks (`prepare_data_gen_config`,
`check_sft_config`, the PPO `check_config`, `prepare_eval_config`), in one process, without reading data, loading a
model or writing anything. The first bad setting, Hydra key typos included, is one line naming the stage, and exit
status 2. run_spa.sh and run_baseline.sh run it before their first stage (the stage scripts print their commands
under SPA_PRINT_STAGE=1, scripts/common.sh), and `python -m SPA_agent.spa_arms` before its stages: a setting that only
a later stage reads used to be refused after the earlier stages had run for minutes.
"""

from __future__ import annotations

import difflib
import importlib
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from SPA_agent.config import CONFIG_DIR
from SPA_agent.entry import EXIT_USAGE, USER_ERRORS
from SPA_agent.stages import SFT_CONFIG_CHECK
from SPA_agent.stages import STAGES as PIPELINE

SEPARATOR = "--then"
SFT_CONFIG_DIR = Path(__file__).resolve().parents[1] / "sft" / "config"


def _compose(config_dir: Path, config_name: str, overrides: Sequence[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    if not (config_dir / f"{config_name}.yaml").is_file():
        known = sorted(p.stem for p in config_dir.glob("*.yaml"))
        raise ValueError(f"unknown config name {config_name!r}; choose one of {known}")
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def check_data(config_name: str, overrides: Sequence[str]) -> None:
    from SPA_agent.selfplay.generate import prepare_data_gen_config

    prepare_data_gen_config(_compose(CONFIG_DIR, config_name, overrides), config_name)


def check_sft(config_name: str, overrides: Sequence[str]) -> None:
    module, function = SFT_CONFIG_CHECK.split(":")
    check_sft_config = getattr(importlib.import_module(module), function)
    cfg = _compose(SFT_CONFIG_DIR, config_name, overrides)
    check_sft_config(cfg, cfg.trainer.preflight_nproc or 1)


def check_ppo(config_name: str, overrides: Sequence[str]) -> None:
    from SPA_agent.trainer.config_checks import check_config

    check_config(_compose(CONFIG_DIR, config_name, overrides))


def check_evaluation(config_name: str, overrides: Sequence[str]) -> None:
    from SPA_agent.evaluation.evaluate import prepare_eval_config

    prepare_eval_config(_compose(CONFIG_DIR, config_name, overrides), config_name)


#: stage -> (config dir, default config name, check)
CHECKS = {"data": (CONFIG_DIR, None, check_data), "sft": (SFT_CONFIG_DIR, "sft_trainer", check_sft),
          "ppo": (CONFIG_DIR, "_2_sokoban", check_ppo), "evaluation": (CONFIG_DIR, None, check_evaluation)}
#: entry-point module -> (stage name in messages, config dir, default config name, check), in pipeline order
STAGES: dict[str, tuple[str, Path, str | None, Callable[[str, Sequence[str]], None]]] = {
    stage.module: (stage.title, *CHECKS[stage.name]) for stage in PIPELINE if stage.name in CHECKS}


def split_command(argv: Sequence[str]) -> tuple[str, str | None, list[str]]:
    """(module, --config-name, Hydra overrides) of `[python] -m <module> [--config-name X] overrides...`."""
    argv = list(argv)
    if "-m" not in argv or argv.index("-m") + 1 >= len(argv):
        raise ValueError(f"not a `python -m <stage>` command: {' '.join(argv)}")
    module, rest = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2:]
    config_name, overrides, i = None, [], 0
    while i < len(rest):
        if rest[i] in ("--config-name", "-cn") and i + 1 < len(rest):
            config_name, i = rest[i + 1], i + 2
            continue
        if rest[i].startswith("--config-name="):
            config_name = rest[i].split("=", 1)[1]
        else:
            overrides.append(rest[i])
        i += 1
    return module, config_name, overrides


def describe_composition_error(err: Exception, config_dir: Path, config_name: str) -> str:
    """One line for Hydra's multi-line composition errors: an unknown key with its close matches, or an unknown
    option of a config group with the known ones."""
    text = str(err)
    if key := re.match(r"Could not override '([^']+)'", text):
        key = key.group(1)
        known = list(_flat_keys(OmegaConf.to_container(_compose(config_dir, config_name, []), resolve=False)))
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        return f"{key} is not a setting{hint} (+{key}=... adds a new one)"
    if missing := re.search(r"Could not find '([^']+)/([^']+)'", text):
        options = re.findall(r"^\t(\S+)$", text.split("Available options", 1)[-1].split("Config search path")[0], re.M)
        return f"{missing.group(1)}={missing.group(2)} is not one of {', '.join(options) or 'the known options'}"
    return text.strip().splitlines()[0] if text.strip() else type(err).__name__


def _flat_keys(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat_keys(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1]


def check_command(argv: Sequence[str]) -> None:
    """Compose and check one stage's command; ValueError naming the stage and the first bad setting."""
    module, config_name, overrides = split_command(argv)
    if module not in STAGES:
        raise ValueError(f"no settings check for the stage {module}; known: {', '.join(STAGES)}")
    stage, config_dir, default_name, check = STAGES[module]
    config_name = config_name or default_name
    if config_name is None:
        raise ValueError(f"{stage}: pass --config-name")
    try:
        check(config_name, overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ValueError(f"{stage}: {describe_composition_error(err, config_dir, config_name)}") from None
    except USER_ERRORS as err:
        raise ValueError(f"{stage}: {err}") from None


def check_commands(commands: Sequence[Sequence[str]]) -> None:
    """`check_command` for each command, in order."""
    for command in commands:
        check_command(command)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv:
        print(f"error: usage: python -m SPA_agent.pipeline_check -m <stage> [args...] [{SEPARATOR} -m <stage> ...]",
              file=sys.stderr)
        return EXIT_USAGE
    commands, current = [], []
    for arg in argv:
        if arg == SEPARATOR:
            commands.append(current)
            current = []
        else:
            current.append(arg)
    commands.append(current)
    try:
        check_commands(commands)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())

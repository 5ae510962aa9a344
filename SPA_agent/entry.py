"""Helpers shared by the data-generation and evaluation entry points: config blocks, model checks, exit codes."""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from SPA_agent.config import CONFIG_DIR, compose_in
from SPA_agent.envs.base import RENDER_MODES
from SPA_agent.generators.base import GenerationError, MissingExtraError
from SPA_agent.rollout.es_manager import check_env_groups

EXIT_USAGE = 2  # user mistakes: bad config value, missing file, a directory that is not a model
EXIT_INTERRUPTED = 130  # Ctrl-C, as the shell reports a process stopped by SIGINT (128 + 2)
#: what an entry point reports as one line (and exit status 2) instead of a traceback
USER_ERRORS = (ValueError, FileNotFoundError, MissingExtraError, GenerationError)


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Inside an entry point: a user mistake (USER_ERRORS) prints one line and exits with status 2."""
    try:
        yield
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


@contextmanager
def exit_on_interrupt(resume_hint: str) -> Iterator[None]:
    """Inside an entry point: Ctrl-C prints one line (what was kept and how to continue, `resume_hint`) and exits
    with status 130 instead of a traceback; locks and partial files are left as the interrupted code left them."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"interrupted: {resume_hint}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def hydra_entry(config_dir: Path, config_name: str | None = None) -> Callable:
    """`@hydra.main(config_path=config_dir, config_name=config_name)` that composes the command line once before
    Hydra does: an unknown config name, config-group option or key is one line with the close matches and exit
    status 2 (`SPA_agent.config.composition_error`), not Hydra's report of 7 to 26 lines."""
    import hydra

    def decorator(task: Callable[[DictConfig], None]) -> Callable[[], None]:
        hydra_main = hydra.main(config_path=str(config_dir), config_name=config_name, version_base="1.3")(task)

        @functools.wraps(task)
        def main(*passthrough) -> None:
            if not passthrough:
                with exit_on_user_error():
                    check_command_line(config_dir, config_name, sys.argv[1:])
            hydra_main(*passthrough)

        return main

    return decorator


def check_command_line(config_dir: Path, config_name: str | None, argv: Sequence[str]) -> None:
    """Compose what `argv` (Hydra's command line) asks for; ValueError in one line if it cannot be. Help, multirun
    sweeps and other config directories are left to Hydra."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(list(argv))
    name = args.config_name or config_name
    if name is None or args.help or args.hydra_help or args.shell_completion or args.multirun or args.info \
            or args.config_path or args.config_dir or args.experimental_rerun:
        return
    compose_in(config_dir, name, args.overrides, return_hydra_config=True)


def check_choice(cfg: DictConfig, key: str, choices: Sequence[str]) -> None:
    """Raise ValueError naming `key` unless its value is one of `choices` (listed in the message)."""
    value = OmegaConf.select(cfg, key)
    if value not in choices:
        raise ValueError(f"{key} must be one of {tuple(choices)}, got {value!r}")


def check_number(cfg: DictConfig, key: str, low: float, high: float | None = None, integer: bool = False,
                 high_open: bool = False) -> None:
    """Raise ValueError naming `key` unless its value is a number (an int when `integer`) in [low, high] (or
    [low, high) with `high_open`); checked before any work so a typo never costs a run."""
    value = OmegaConf.select(cfg, key)
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ValueError(f"{key} must be {kind}, got {value!r}")
    above = high is not None and (value >= high if high_open else value > high)
    if value < low or above:
        bounds = f">= {low}" if high is None else f"in [{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{key} must be {bounds}, got {value}")


def check_numbers(cfg: DictConfig, table: tuple[tuple, ...]) -> None:
    """`check_number` for each `(key, low, high, integer)` of `table`; keys whose value is null are skipped."""
    for key, low, high, integer in table:
        if OmegaConf.select(cfg, key) is not None:
            check_number(cfg, key, low, high, integer=integer)


def check_list(cfg: DictConfig, key: str, item_type: type = int, example: str = "[1,8]") -> list:
    """The value of `key` as a list; ValueError naming `key` unless it is a list of `item_type` (a number where
    a list is expected would otherwise fail later as "'int' object is not iterable")."""
    value = OmegaConf.select(cfg, key)
    items = list(value) if OmegaConf.is_list(value) or isinstance(value, list) else None
    kinds = (int, float) if item_type is float else item_type
    if items is None or any(isinstance(v, bool) or not isinstance(v, kinds) for v in items):
        kind = {int: "integers", float: "numbers", str: "strings"}.get(item_type, item_type.__name__)
        raise ValueError(f"{key} must be a list of {kind} such as {key}={example}, got {value!r}")
    return items


@contextmanager
def model_load_errors(model_path: str) -> Iterator[None]:
    """Inside: a model directory that cannot be loaded (truncated weights, a corrupt config) raises a one-line
    ValueError naming it instead of a loader's traceback (shared by PPO, evaluation and data generation)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"cannot load the model {model_path}: {reason}") from None


def check_rollout_settings(cfg: DictConfig) -> None:
    """Settings every stage that plays the envs needs (data generation, evaluation, PPO), checked before any model
    is loaded: lengths, the env groups and tags of both splits, and the render mode (which picks the instructions'
    texts, so a wrong one would otherwise surface as an interpolation error)."""
    check_number(cfg, "actor_rollout_ref.rollout.response_length", 1, integer=True)
    check_number(cfg, "agent_proxy.max_turn", 1, integer=True)
    for split in ("train", "val"):
        check_list(cfg, f"es_manager.{split}.env_configs.tags", str, "[SimpleSokoban]")
        check_list(cfg, f"es_manager.{split}.env_configs.n_groups", int, "[4]")
        check_env_groups(cfg, split)
    check_choice(cfg, "render_mode", RENDER_MODES)
    tags = {tag for split in ("train", "val") for tag in cfg.es_manager[split].env_configs.tags}
    for tag in sorted(tags):
        key = f"custom_envs.{tag}.env_config.render_mode"
        if OmegaConf.select(cfg, key) is not None:
            check_choice(cfg, key, RENDER_MODES)


def current_config_name() -> str | None:
    """`--config-name` of the running Hydra app, or None outside `@hydra.main`."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().job.config_name


def prepare_config(cfg: DictConfig, block: str, config_name: str | None = None) -> DictConfig:
    """A copy of `cfg` with `config_name` set (from the argument, Hydra, or an existing `config_name` key) and
    the `<block>` defaults of `config/<block>.yaml` filled in under any values already present."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    name = config_name or current_config_name() or cfg.get("config_name")
    if not name:
        raise ValueError("unknown config name: pass --config-name (or set config_name=...)")
    defaults = OmegaConf.load(CONFIG_DIR / f"{block}.yaml")
    merged = OmegaConf.merge(defaults, cfg)
    with open_dict(merged):
        merged.config_name = name
    OmegaConf.set_struct(merged, True)
    check_rollout_settings(merged)
    return merged


def apply_system_env(cfg: DictConfig) -> None:
    """Copy `system.CUDA_VISIBLE_DEVICES` into the environment when set and the variable is not (spec §8)."""
    devices = (cfg.get("system") or {}).get("CUDA_VISIBLE_DEVICES")
    if devices is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(devices)


def resolve_checkpoint(model_path: str) -> str:
    """The directory or hub id to load: `tiny` → the embedded model; a local directory must be a Hugging Face
    model directory (SFT checkpoints: `<dir>/global_step_N`; PPO checkpoints: `<run>/global_step_N/actor`)."""
    from SPA_agent.model_presets import resolve_model_path

    resolved = resolve_model_path(str(model_path))
    path = Path(resolved)
    if path.is_dir() and not (path / "config.json").is_file():
        sft_steps = [p for p in path.glob("global_step_*") if (p / "config.json").is_file()]
        models = {int(m.group(1)): p for p in [*sft_steps, *path.glob("global_step_*/actor")]
                  if (m := re.search(r"global_step_(\d+)", p.relative_to(path).as_posix()))}
        hint = f"; did you mean {models[max(models)]}?" if models else ""
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json){hint}")
    local = resolved.startswith((".", "/", "~")) or resolved.count("/") > 1 or ("/" in resolved and path.parent.is_dir())
    if not path.exists() and local:  # not a hub id (org/name) either: `org` would be a local directory
        raise FileNotFoundError(f"model_path {resolved} does not exist (relative paths start at {Path.cwd()})")
    return resolved


def load_tokenizer(model_path: str):
    """The tokenizer of `model_path` (checked by `resolve_checkpoint`)."""
    from transformers import AutoTokenizer

    resolved = resolve_checkpoint(model_path)
    try:
        return AutoTokenizer.from_pretrained(resolved)
    except OSError as err:
        raise FileNotFoundError(f"cannot load a tokenizer from {resolved}: {err}") from err

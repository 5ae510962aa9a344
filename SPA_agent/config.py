"""Loading the Hydra configs under `config/` outside a `@hydra.main` entry point (tests, notebooks, scripts), and
Hydra's composition errors as one line with the close matches (every entry point checks its command line with
`SPA_agent.entry.hydra_entry` before Hydra runs)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"
ENTRY_CONFIGS = ("_2_sokoban", "_3_frozen_lake", "_10_sudoku")


def compose(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose `config/<config_name>.yaml` with command-line style overrides, e.g. ["model=tiny"]. An unknown
    config name, key or option raises ValueError in one line (`composition_error`)."""
    return compose_in(CONFIG_DIR, config_name, overrides)


def compose_in(config_dir: Path, config_name: str, overrides: Sequence[str] = (),
               return_hydra_config: bool = False) -> DictConfig:
    """`compose` for any config directory; `return_hydra_config` accepts `hydra.*` overrides, as `@hydra.main`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=list(overrides),
                                 return_hydra_config=return_hydra_config)
    except (HydraException, OmegaConfBaseException) as err:
        raise ValueError(composition_error(err, Path(config_dir), config_name, overrides)) from None


def close_matches(word: str, choices: Iterable[str]) -> str:
    """` (did you mean a, b?)` with the closest of `choices` to `word` (difflib's similarity, at least 0.6), up to
    three where they are about as close as the best one (`spa_grp`: spa_grpo, not spa); `` when none is close."""
    scored = []
    for choice in dict.fromkeys(choices):
        matcher = difflib.SequenceMatcher(None, word, choice)
        if matcher.real_quick_ratio() >= 0.6 and matcher.quick_ratio() >= 0.6 and matcher.ratio() >= 0.6:
            scored.append((matcher.ratio(), choice))
    scored.sort(key=lambda pair: -pair[0])
    matches = [choice for score, choice in scored[:3] if score >= scored[0][0] - 0.05]
    return f" (did you mean {', '.join(matches)}?)" if matches else ""


def composition_error(err: Exception, config_dir: Path, config_name: str, overrides: Sequence[str]) -> str:
    """One line for a Hydra composition error: an unknown config name, option of a config group (`model=tny`,
    `experiment=spa_grp`) or key (`evaluaton.n=2`), with the close matches; otherwise Hydra's first line."""
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, name = str(err.missing_cfg_file).rpartition("/")
        choices = err.options or ([] if group else entry_configs(config_dir))
        what = f"config name {name!r}" if not group else f"{group.replace('/', '.')} {name!r}"
        return f"unknown {what}{close_matches(name, choices)}; choose one of {', '.join(choices)}"
    found = re.match(r"Could not override '([^']+)'", str(err))
    cause = err.__cause__
    if found and cause is not None and type(cause).__name__ in ("ConfigKeyError", "ConfigAttributeError"):
        key = found.group(1)
        typed = next((o for o in overrides if o.split("=", 1)[0] == key), key)
        known = config_keys(config_dir, config_name, overrides)
        return f"unknown key {key!r} in {typed}{close_matches(key, known)}; +{typed} adds a new key"
    first = _first_line(getattr(err, "message", None) or str(err)) or type(err).__name__
    override = getattr(err, "override", None)
    if override:
        return f"cannot read the override {override!r}: {first}"
    return f"{first} {_first_line(str(cause))}" if cause is not None and _first_line(str(cause)) else first


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def entry_configs(config_dir: Path) -> list[str]:
    """The configs of `config_dir` to name in `--config-name`: `_*.yaml` where there are such (config/'s others,
    base, envs, ..., are their parts), else every one (sft/config/sft_trainer.yaml)."""
    names = sorted(p.stem for p in config_dir.glob("*.yaml"))
    return [name for name in names if name.startswith("_")] or names


def config_keys(config_dir: Path, config_name: str, overrides: Sequence[str]) -> list[str]:
    """Every dotted key of the config composed with the config-group choices among `overrides` (`model=tiny`), or
    with none of them if that fails: the keys an override may set."""
    groups = [o for o in overrides if re.fullmatch(r"[\w.-]+=[^=]*", o) and (config_dir / o.split("=")[0]).is_dir()]
    for choices in (groups, []):
        try:
            cfg = compose_in(config_dir, config_name, choices)
        except ValueError:
            continue
        return list(_dotted(OmegaConf.to_container(cfg, resolve=False)))
    return []


def _dotted(node, prefix: str = "") -> Iterable[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}{key}"
            yield path
            yield from _dotted(value, f"{path}.")

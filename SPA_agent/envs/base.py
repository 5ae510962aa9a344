"""The environment protocol (spec §3.1), the registry from `env_type` to (env class, config class), and
the helpers every environment shares: seeding without touching global RNG state, config validation and
the deterministic fallback seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np

RENDER_MODES = ("text", "text_with_coordinates")
MAX_SEED = 2**32
"""Seeds are integers in [0, 2**32): the legacy numpy generator accepts nothing larger."""


class BaseEnv(ABC):
    """A text environment: `reset` and `step` return the state rendered as the model sees it.

    Subclasses set `config` (a dataclass instance) in `__init__` and implement `reset`, `step`,
    `render` and `get_all_actions`. `step` returns the 4-tuple `(observation, reward, done, info)`, where
    `info` has the bools `success`, `action_is_valid` and `action_is_effective`.
    """

    config: Any
    env_type: ClassVar[str] = ""

    @abstractmethod
    def reset(self, seed: int | None = None, mode: str | None = None) -> str:
        """Start the instance of `seed` (a fresh random one if None); `mode` ("train"/"val") is accepted
        for RAGEN's calling convention and ignored. Returns the render."""

    @abstractmethod
    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        """Apply one action; returns (render, reward, done, info)."""

    @abstractmethod
    def render(self) -> str:
        """The current state in the config's `render_mode`."""

    @abstractmethod
    def get_all_actions(self) -> list[str]:
        """Every action name the model may write."""

    def close(self) -> None:
        """Release resources (none by default)."""


REGISTRY: dict[str, tuple[type[BaseEnv], type]] = {}


def register(env_class: type[BaseEnv], config_class: type) -> None:
    """Add `env_class` to `REGISTRY` under its `env_type`."""
    REGISTRY[env_class.env_type] = (env_class, config_class)


def make_env(env_type: str, env_config: Mapping | None = None) -> BaseEnv:
    """Build the env registered as `env_type` from the keyword arguments in `env_config` (None = defaults).

    Raises ValueError for an unknown `env_type`, unknown config keys or invalid values.
    """
    if env_type not in REGISTRY:
        raise ValueError(f"unknown env_type {env_type!r}; registered: {sorted(REGISTRY)}")
    env_class, config_class = REGISTRY[env_type]
    return env_class(build_config(config_class, env_config))


def build_config(config_class: type, env_config: Mapping | None) -> Any:
    """`config_class(**env_config)` with nested mappings (e.g. an OmegaConf DictConfig) turned into dicts."""
    values = {str(k): _plain(v) for k, v in (env_config or {}).items()}
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"{config_class.__name__}: unknown env_config keys {unknown}; valid keys: {sorted(known)}"
        )
    return config_class(**values)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def check(condition: bool, config: Any, field: str, requirement: str) -> None:
    """Raise ValueError naming the config class and `field` unless `condition` holds."""
    if not condition:
        value = getattr(config, field)
        raise ValueError(f"{type(config).__name__}.{field}={value!r}: {requirement}")


def int_keyed(mapping: Mapping, config: Any, field: str) -> dict[int, str]:
    """A lookup table whose keys may arrive as strings (JSON, CLI overrides) with integer keys."""
    try:
        return {int(k): str(v) for k, v in mapping.items()}
    except (TypeError, ValueError, AttributeError):
        raise ValueError(
            f"{type(config).__name__}.{field}={mapping!r}: must map integers to strings"
        ) from None


def resolve_seed(seed: int | None) -> int:
    """`seed` checked to lie in [0, 2**32), or a fresh random seed if None."""
    if seed is None:
        return secrets.randbelow(MAX_SEED)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed={seed!r}: must be an integer in [0, 2**32) or None")
    return int(seed)


def fallback_seed(seed: int) -> int:
    """The seed tried after `seed` fails to give an instance: the first 4 bytes of SHA-256(str(seed)).

    The original used `abs(hash(str(seed))) % 2**32`, which depends on PYTHONHASHSEED; this does not.
    """
    return int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:4], "big")


@contextmanager
def legacy_global_seed(seed: int) -> Iterator[None]:
    """Seed Python's `random` and numpy's legacy global RNG with `seed`, restoring both states on exit."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def coordinate_sentence(clauses: list[tuple[str, tuple[int, int]]]) -> str:
    """`Player (P) is at (3,2); box (X) is at (3,1).` from [("Player (P)", (3, 2)), ("box (X)", (3, 1))]."""
    return "; ".join(f"{name} is at ({r},{c})" for name, (r, c) in clauses) + "."

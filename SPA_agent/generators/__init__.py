"""Text generators behind one interface (docs/interfaces.md "Generators"): `hf`, `vllm`, `api`, `random`,
`solver`.

`build_generator(cfg.generator, cfg.model_path, tokenizer)` picks the backend named by `cfg.name`; backends
with optional packages (vllm, openai) import them only when chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from SPA_agent.generators.base import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    Generator,
    Prompt,
    SamplingParams,
)


def _build_hf(cfg, model_path, tokenizer, model):
    from SPA_agent.generators.hf import HFGenerator

    return HFGenerator.from_config(cfg, model_path, tokenizer, model=model)


def _build_vllm(cfg, model_path, tokenizer, model):
    from SPA_agent.generators.vllm import VLLMGenerator

    return VLLMGenerator.from_config(cfg, model_path, tokenizer)


def _build_api(cfg, model_path, tokenizer, model):
    from SPA_agent.generators.api import APIGenerator

    return APIGenerator.from_config(cfg)


def _build_random(cfg, model_path, tokenizer, model):
    from SPA_agent.generators.random import RandomGenerator

    return RandomGenerator.from_config(cfg)


def _build_solver(cfg, model_path, tokenizer, model):
    from SPA_agent.generators.solver import SolverGenerator

    return SolverGenerator.from_config(cfg)


BUILDERS: dict[str, Callable[..., Generator]] = {
    "hf": _build_hf,
    "vllm": _build_vllm,
    "api": _build_api,
    "random": _build_random,
    "solver": _build_solver,
}
#: what chooses the actions of a generator's data (the data card's `action_source`)
ACTION_SOURCES = {"hf": "model", "vllm": "model", "api": "model", "random": "random", "solver": "solver"}
#: env types a generator can play, for the generators that cannot play every env
ENV_TYPES = {"solver": ("sokoban",)}


def build_generator(cfg: Mapping[str, Any], model_path: str, tokenizer, model=None) -> Generator:
    """The generator named by `cfg.name` (the `generator` config group).

    `model` (hf only) is an already-loaded causal LM, e.g. the PPO actor, so generation uses its current
    weights; otherwise `model_path` is loaded (`tiny` = the embedded test model).
    """
    name = cfg.get("name")
    if name not in BUILDERS:
        raise ValueError(f"unknown generator {name!r}; choose one of {sorted(BUILDERS)} (e.g. generator=hf)")
    return BUILDERS[name](cfg, model_path, tokenizer, model)


def check_env_types(cfg: Mapping[str, Any], env_types: Iterable[str]) -> None:
    """Raise ValueError when the generator named by `cfg.name` cannot play one of `env_types` (checked before
    any work: `generator=solver` plays Sokoban only)."""
    name = cfg.get("name")
    playable = ENV_TYPES.get(name)
    unplayable = sorted(set(env_types) - set(playable)) if playable is not None else []
    if unplayable:
        raise ValueError(f"generator={name} cannot play env type(s) {unplayable}: it plays {list(playable)} only "
                         "(docs/generators.md)")


__all__ = [
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Generation",
    "Generator",
    "Prompt",
    "SamplingParams",
    "build_generator",
    "check_env_types",
]

"""Text generators behind one interface (docs/interfaces.md "Generators"): `hf`, `vllm`, `api`, `random`.

`build_generator(cfg.generator, cfg.model_path, tokenizer)` picks the backend named by `cfg.name`; backends
with optional packages (vllm, openai) import them only when chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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


BUILDERS: dict[str, Callable[..., Generator]] = {
    "hf": _build_hf,
    "vllm": _build_vllm,
    "api": _build_api,
    "random": _build_random,
}


def build_generator(cfg: Mapping[str, Any], model_path: str, tokenizer, model=None) -> Generator:
    """The generator named by `cfg.name` (the `generator` config group).

    `model` (hf only) is an already-loaded causal LM, e.g. the PPO actor, so generation uses its current
    weights; otherwise `model_path` is loaded (`tiny` = the embedded test model).
    """
    name = cfg.get("name")
    if name not in BUILDERS:
        raise ValueError(f"unknown generator {name!r}; choose one of {sorted(BUILDERS)} (e.g. generator=hf)")
    return BUILDERS[name](cfg, model_path, tokenizer, model)


__all__ = [
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Generation",
    "Generator",
    "Prompt",
    "SamplingParams",
    "build_generator",
]

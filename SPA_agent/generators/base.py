"""The generator protocol: batched chat prompts in; text, sampled token ids and finish reason out (spec
§7.2–§7.4).

Every backend (`hf`, `vllm`, `api`, `random`, `solver`) implements `Generator.generate`. Text generators know
nothing of environments: a `Prompt` carries everything they need, already rendered by the context manager. The
one exception is an expert that plans on the true state (`solver`): it declares `needs_env = True`, and only then
does the agent proxy put a copy of the env into `Prompt.env`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

FINISH_STOP = "stop"  # the model ended its turn (an end-of-turn token was sampled)
FINISH_LENGTH = "length"  # max_new_tokens reached before the end of the turn
FINISH_ERROR = "error"  # the request failed (api generator with allow_failures=True only)


class MissingExtraError(ImportError):
    """An optional package a generator needs is not installed (the message names the extra to install)."""


class GenerationError(RuntimeError):
    """A generator could not produce text (e.g. an endpoint still failing after its retries)."""


@dataclass
class Prompt:
    """One chat to continue.

    `prompt_ids` is `messages` rendered with the chat template, the generation prompt and `response_prefix`
    included; local models continue from it. Remote models receive `messages` (they cannot be forced to open
    their turn with `response_prefix`). `env` is a copy of the env at this turn, set only for generators that
    declare `needs_env = True` (experts that plan on the true state); a model never sees it. `conversation` names
    the chat this prompt continues (the agent proxy's rollout and env): a generator with a prefix cache
    (generator.reuse_prefix_cache) prefills only what it does not hold of that chat already.
    """

    messages: list[dict]
    prompt_ids: list[int]
    response_prefix: str = "<think>"
    action_space: list[str] = field(default_factory=list)
    worldmodel: bool = False
    env: Any = None
    conversation: Hashable | None = None


@dataclass
class Generation:
    """One continuation: `text` follows `response_prefix`; `token_ids` are the sampled ids (end-of-turn token
    included when emitted, no padding), None for generators without a local model."""

    text: str
    token_ids: list[int] | None
    finish_reason: str


@runtime_checkable
class Generator(Protocol):
    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        """One Generation per prompt, in the same order."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by the model-backed generators (spec §7.2).

    temperature 0 means greedy decoding; top_k -1 means no top-k filter; top_p 1 means no nucleus filter.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 400
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"generator.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generator.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"generator.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"generator.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> SamplingParams:
        """Read temperature, top_p, top_k, max_new_tokens and seed from a generator config (missing keys keep
        their defaults)."""
        keys = ("temperature", "top_p", "top_k", "max_new_tokens", "seed")
        values = {key: cfg[key] for key in keys if cfg.get(key) is not None}
        types = {"temperature": float, "top_p": float, "top_k": int, "max_new_tokens": int, "seed": int}
        return cls(**{key: types[key](value) for key, value in values.items()})


def call_seed(seed: int, call_index: int) -> int:
    """Seed of the `call_index`-th generate call of a generator seeded with `seed`: a fresh generator replays
    the same calls with the same random streams, while consecutive calls get independent streams."""
    import numpy as np

    return int(np.random.SeedSequence([seed, call_index]).generate_state(1)[0])


def stop_token_ids(tokenizer, *configs) -> list[int]:
    """Ids that end an assistant turn: the eos ids of the tokenizer and of each config given (a model's
    generation config and config; Qwen2.5: `<|im_end|>` and `<|endoftext|>`). Sorted, without repeats."""
    ids: set[int] = set()
    for source in (*configs, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if not ids:
        raise ValueError(
            "neither the model nor the tokenizer defines an eos token: cannot detect the end of a turn"
        )
    return sorted(ids)

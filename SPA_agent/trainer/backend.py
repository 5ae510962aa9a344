"""The worker-group protocol between the PPO driver and the models, and the registry of backends.

The driver (`ppo_trainer.py`) only calls these methods; how models are placed, sharded or batched is the
backend's business. `local` keeps actor, critic and reference in one process on one device; `verl` runs them on
verl's Ray/FSDP workers with a vLLM or SGLang rollout (multi-GPU, multi-node; docs/scale_out.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

from omegaconf import DictConfig
from verl import DataProto

#: backend name -> "module:class"
BACKENDS = {"local": "SPA_agent.trainer.local_backend.backend:LocalBackend",
            "verl": "SPA_agent.trainer.verl_backend.backend:VerlBackend"}


class WorkerGroup(Protocol):
    """Keys read/added refer to the rollout batch of docs/interfaces.md; (B, T-1) tensors unless noted."""

    #: whether a frozen reference policy exists (`actor_rollout_ref.actor.use_ref`)
    has_ref: bool

    def generate(self, prompts: list) -> list:
        """The generator interface (SPA_agent.generators): prompts in, generations out, current weights."""

    def compute_log_prob(self, batch: DataProto) -> DataProto:
        """Reads input_ids/attention_mask/position_ids; returns `old_log_probs` and `entropys`."""

    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        """Returns `ref_log_prob` from the frozen reference policy."""

    def compute_values(self, batch: DataProto) -> DataProto:
        """Returns `values` (critic output, zero outside `response_mask`)."""

    def update_critic(self, batch: DataProto) -> dict[str, float]:
        """Reads values, returns, response_mask; one PPO value update; returns `critic/*` metrics."""

    def update_actor(self, batch: DataProto) -> dict[str, float]:
        """Reads old_log_probs, advantages, response_mask (and ref_log_prob for a KL loss); `actor/*` metrics."""

    def step_timings(self) -> dict[str, float]:
        """Seconds of the backend's own work inside the step's phases since the last call (`timing_s/<name>`)."""

    def save(self, directory: Path) -> None:
        """Write `directory/actor` (Hugging Face dir + tokenizer + optimizer) and `directory/critic`."""

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (weights and optimizer states)."""


def build_backend(cfg: DictConfig, tokenizer) -> WorkerGroup:
    """Construct the backend named by `trainer.backend`."""
    name = cfg.trainer.backend
    if name not in BACKENDS:
        raise ValueError(f"unknown trainer.backend {name!r}; choose one of {sorted(BACKENDS)}")
    module_name, class_name = BACKENDS[name].split(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class(cfg, tokenizer)

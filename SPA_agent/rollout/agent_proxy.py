"""LLMAgentProxy: the multi-turn loop (spec §7.1).

reset → for each turn: build prompts → generate → parse → step the envs → stop when all are done; then
the training batch over all envs. The generator is passed in (any object with `generate(prompts)`), so the
same loop serves data generation, PPO and evaluation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from verl import DataProto

from SPA_agent.generators.base import FINISH_STOP, Generator, Prompt
from SPA_agent.rollout.ctx_manager import ContextManager
from SPA_agent.rollout.es_manager import EnvStateManager, check_env_groups
from SPA_agent.rollout.turns import EnvCache, EnvRecord
from SPA_agent.runs.progress import progress_bar


@dataclass
class Rollout:
    """One rollout: the training batch (docs/interfaces.md) and the per-env records with full histories."""

    batch: DataProto
    states: list[EnvRecord]

    @property
    def metrics(self) -> dict[str, float]:
        return self.batch.meta_info["metrics"]


class LLMAgentProxy:
    def __init__(self, config: Mapping, generator: Generator, tokenizer, progress: bool = False):
        for split in ("train", "val"):
            check_env_groups(config, split)
        self.config = config
        self.generator = generator
        self.ctx = ContextManager(config, tokenizer)  # its prompt mode: config ctx_manager.mode
        self.max_turn = int(config["agent_proxy"]["max_turn"])
        if self.max_turn < 1:
            raise ValueError(f"agent_proxy.max_turn must be >= 1, got {self.max_turn}")
        self.progress = progress
        self._managers: dict[str, EnvStateManager] = {}

    def es_manager(self, val: bool) -> EnvStateManager:
        """The train or val env-state manager, built on first use (val holds 1,024 envs by default)."""
        split = "val" if val else "train"
        if split not in self._managers:
            self._managers[split] = EnvStateManager(self.config, split)
        return self._managers[split]

    def rollout(self, val: bool = False, seed: int | None = None) -> Rollout:
        es = self.es_manager(val)
        active = es.reset(seed=seed)
        turns = progress_bar(range(self.max_turn), desc="val rollout turns" if val else "rollout turns", leave=False,
                             disable=not self.progress)
        for _ in turns:
            prompts = self._prompts(es, active)
            generations = self.generator.generate(prompts)
            env_inputs = self.ctx.get_env_inputs(
                active,
                texts=[g.text for g in generations],
                ids=[g.token_ids for g in generations],
                finished=[g.finish_reason == FINISH_STOP for g in generations],
            )
            active = es.step(env_inputs)
            if not active:
                break
        states = es.get_rollout_states()
        tensors, non_tensors, metrics = self.ctx.formulate_rollouts(states)
        batch = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"metrics": metrics})
        return Rollout(batch=batch, states=states)

    def _prompts(self, es: EnvStateManager, caches: list[EnvCache]) -> list[Prompt]:
        """One prompt per active env; a copy of the env goes with it only to generators that declare
        `needs_env = True` (the solver), so a model generator never sees the true state."""
        worldmodel = self.ctx.mode == "add_worldmodel"
        needs_env = bool(getattr(self.generator, "needs_env", False))
        return [
            Prompt(messages=messages, prompt_ids=ids, response_prefix=self.ctx.prefix,
                   action_space=es.action_space(cache.env_id), worldmodel=worldmodel,
                   env=es.env_snapshot(cache.env_id) if needs_env else None)
            for cache, (messages, ids) in zip(caches, self.ctx.get_lm_inputs(caches))
        ]

    def messages(self, state: EnvRecord, normalized: bool = True) -> list[dict]:
        """The chat of one finished trajectory (see ContextManager.messages)."""
        return self.ctx.messages(state, normalized=normalized, for_update=True)

    def state_dict(self) -> dict:
        """Env seed counters, so a resumed run continues with the same puzzles (fixes spec §12.23)."""
        return {split: manager.state_dict() for split, manager in self._managers.items()}

    def load_state_dict(self, state: Mapping) -> None:
        for split, manager_state in state.items():
            self.es_manager(split == "val").load_state_dict(manager_state)

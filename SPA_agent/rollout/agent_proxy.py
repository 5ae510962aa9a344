"""LLMAgentProxy: the multi-turn loop (spec §7.1).

reset → for each turn: build prompts → generate → parse → step the envs → stop when all are done; then
the training batch over all envs. The generator is passed in (any object with `generate(prompts)`), so the
same loop serves data generation, PPO and evaluation.

With agent_proxy.pipeline_turns and a generator that can (`can_serve`: hf with the static decoder), the turns are
pipelined instead: the generator's `serve` hands each env's ended turn back at once, the env steps and its next
prompt starts decoding while the other envs' turns go on (generators/turn_pipeline.py). Each env sees the same
prompts, parsing and steps as turn by turn.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from verl import DataProto

from SPA_agent.generators.base import FINISH_STOP, Generation, Generator, Prompt
from SPA_agent.rollout.ctx_manager import ContextManager
from SPA_agent.rollout.es_manager import EnvStateManager, check_env_groups
from SPA_agent.rollout.turns import EnvCache, EnvRecord
from SPA_agent.runs.progress import progress_bar

#: numbers every rollout of the process: an env's chat is (rollout, env id), so that no rollout continues another's
#: cached keys (Prompt.conversation; computed before the weights changed)
_ROLLOUT_NUMBERS = itertools.count()


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
        pipeline = config["agent_proxy"].get("pipeline_turns", False)
        if pipeline not in (True, False):
            raise ValueError(f"agent_proxy.pipeline_turns must be true or false, got {pipeline!r}")
        self._pipeline_requested = pipeline
        self._managers: dict[str, EnvStateManager] = {}
        self._rollout_number = -1

    @property
    def pipeline_turns(self) -> bool:
        """Whether rollouts pipeline their turns: asked for (agent_proxy.pipeline_turns) and the generator can."""
        return self._pipeline_requested and bool(getattr(self.generator, "can_serve", False))

    def es_manager(self, val: bool) -> EnvStateManager:
        """The train or val env-state manager, built on first use (val holds 1,024 envs by default)."""
        split = "val" if val else "train"
        if split not in self._managers:
            self._managers[split] = EnvStateManager(self.config, split)
        return self._managers[split]

    def rollout(self, val: bool = False, seed: int | None = None) -> Rollout:
        es = self.es_manager(val)
        active = es.reset(seed=seed)
        self._rollout_number = next(_ROLLOUT_NUMBERS)
        if self.pipeline_turns:
            self._pipelined_turns(es, active, val)
        else:
            self._turn_by_turn(es, active, val)
        states = es.get_rollout_states()
        tensors, non_tensors, metrics = self.ctx.formulate_rollouts(states)
        batch = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"metrics": metrics})
        return Rollout(batch=batch, states=states)

    def _turn_by_turn(self, es: EnvStateManager, active: list[EnvCache], val: bool) -> None:
        turns = progress_bar(range(self.max_turn), desc="val rollout turns" if val else "rollout turns", leave=False,
                             disable=not self.progress)
        for _ in turns:
            generations = self.generator.generate(self._prompts(es, active))
            active = es.step(self._env_inputs(active, generations))
            if not active:
                break

    def _pipelined_turns(self, es: EnvStateManager, active: list[EnvCache], val: bool) -> None:
        """Every env's turns in one `serve` call: each ended turn steps its env, whose next prompt (or None after
        its last turn) goes back to the generator."""
        turns_taken = [0] * len(active)
        bar = progress_bar(total=len(active), desc="val rollout envs" if val else "rollout envs", leave=False,
                           disable=not self.progress)

        def respond(row: int, generation: Generation) -> Prompt | None:
            cache = active[row]
            es.step(self._env_inputs([cache], [generation]))
            turns_taken[row] += 1
            if es.done(cache.env_id) or turns_taken[row] == self.max_turn:
                bar.update()
                return None
            return self._prompts(es, [cache])[0]

        with bar:
            self.generator.serve(self._prompts(es, active), respond)

    def _env_inputs(self, caches: list[EnvCache], generations: list[Generation]) -> list:
        return self.ctx.get_env_inputs(
            caches,
            texts=[g.text for g in generations],
            ids=[g.token_ids for g in generations],
            finished=[g.finish_reason == FINISH_STOP for g in generations],
        )

    def _prompts(self, es: EnvStateManager, caches: list[EnvCache]) -> list[Prompt]:
        """One prompt per active env; a copy of the env goes with it only to generators that declare
        `needs_env = True` (the solver), so a model generator never sees the true state."""
        worldmodel = self.ctx.mode == "add_worldmodel"
        needs_env = bool(getattr(self.generator, "needs_env", False))
        return [
            Prompt(messages=messages, prompt_ids=ids, response_prefix=self.ctx.prefix,
                   action_space=es.action_space(cache.env_id), worldmodel=worldmodel,
                   env=es.env_snapshot(cache.env_id) if needs_env else None,
                   conversation=(self._rollout_number, cache.env_id))
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

"""One SPA environment episode for a per-trajectory agent loop (pure parts of `agent_loop`; no verl, no Ray).

An `Episode` holds one env in an EnvStateManager and a ContextManager, the same code the LLMAgentProxy runs, so
prompts, parsing, masks and scores are identical. Its output is verl's AgentLoopOutput layout: `prompt_ids` = the
first token of the conversation, `response_ids` = the rest up to the last trained token, `response_mask` = our
loss_mask there. The untrained tail after the last trained token (e.g. the newline the chat template puts after the
end-of-turn token) is dropped, so verl's placement of `reward_score` on the last response token is our placement
on the last loss-mask column.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from SPA_agent.rollout.ctx_manager import ContextManager
from SPA_agent.rollout.es_manager import EnvStateManager


def single_env_config(config: Mapping, tag: str) -> dict:
    """`config` (a plain dict) with a train split of one env of `tag`, seeded explicitly by the episode."""
    one = copy.deepcopy(dict(config))
    one["es_manager"] = {**one["es_manager"], "train": {
        "env_groups": 1, "group_size": 1, "env_configs": {"tags": [tag], "n_groups": [1]}}}
    return one


def check_supported(config: Mapping) -> None:
    """A trajectory alone cannot be normalized against its group, and verl takes one score per trajectory."""
    proxy = config["agent_proxy"]
    if proxy["reward_normalization"]["method"] != "identity":
        raise ValueError("the verl agent loop scores trajectories one by one: set "
                         "agent_proxy.reward_normalization.method=identity")
    if proxy["use_turn_scores"]:
        raise ValueError("the verl agent loop gives one score per trajectory: set agent_proxy.use_turn_scores=False")


class Episode:
    """One env's multi-turn episode: prompts out, sampled ids in, verl's output fields at the end."""

    def __init__(self, config: Mapping, tokenizer, tag: str, seed: int):
        check_supported(config)
        one = single_env_config(config, tag)
        self.es = EnvStateManager(one, "train")
        self.ctx = ContextManager(one, tokenizer)
        self.cache = self.es.reset(seed=seed)[0]
        self.active = True
        self.turns = 0

    def prompt_ids(self) -> list[int]:
        """Ids of the conversation so far, the assistant turn opened with the forced prefix."""
        return self.ctx.get_lm_inputs([self.cache])[0][1]

    def step(self, token_ids: list[int], text: str, finished: bool) -> bool:
        """Parse one sampled turn and step the env; whether the episode goes on."""
        env_input = self.ctx.get_env_inputs([self.cache], [text], [token_ids], [finished])
        self.active = bool(self.es.step(env_input))
        self.turns += 1
        return self.active

    def output_fields(self) -> dict[str, Any]:
        """prompt_ids, response_ids, response_mask, reward_score and metrics in verl's AgentLoopOutput layout."""
        states = self.es.get_rollout_states()
        row = {key: value[0] for key, value in self.ctx.get_masks_and_scores(states).items()}
        loss_mask = row["loss_mask"].long()
        last = int(loss_mask.nonzero().max()) if loss_mask.any() else loss_mask.numel() - 1
        return {
            "prompt_ids": row["input_ids"][:1].tolist(),
            "response_ids": row["responses"][: last + 1].tolist(),
            "response_mask": loss_mask[: last + 1].tolist(),
            "reward_score": float(row["rm_scores"].sum()),
            "metrics": dict(states[0].metrics),
        }

"""The multi-turn env loop as a verl agent loop (`verl.experimental.agent_loop`), for verl's own trainers.

Our driver does not need it: with trainer.backend=verl the LLMAgentProxy keeps the loop and only generation runs
on verl's servers. This loop runs SPA's environments under verl's AgentLoopManager (e.g. its fully asynchronous
trainer), each trajectory its own asyncio task, built from `episode.Episode` (the proxy's own managers).

Use: put our composed config under the key `spa` of verl's config; dataset rows (non-tensor fields) give `tag`
(an env tag of custom_envs), `seed` and `agent_name: spa_env_agent`; point
`actor_rollout_ref.rollout.agent.agent_loop_config_path` at a yaml with
    - name: spa_env_agent
      _target_: SPA_agent.trainer.verl_backend.agent_loop.SPAEnvAgentLoop
Needs verl's agent-loop dependencies (cachetools, uvicorn, fastapi, ...: installed with vllm).
"""

from __future__ import annotations

import uuid
from typing import Any

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from SPA_agent.generators.base import stop_token_ids
from SPA_agent.trainer.verl_backend.episode import Episode

AGENT_NAME = "spa_env_agent"


@register(AGENT_NAME)
class SPAEnvAgentLoop(AgentLoopBase):
    """verl agent loop over one SPA environment episode."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spa_config = OmegaConf.to_container(self.config.spa, resolve=True)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.max_turn = int(self.spa_config["agent_proxy"]["max_turn"])

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        episode = Episode(self.spa_config, self.tokenizer, str(kwargs["tag"]), int(kwargs["seed"]))
        params = {**sampling_params, "stop_token_ids": self.stop_ids,
                  "max_tokens": int(self.rollout_config.response_length)}
        request_id = uuid.uuid4().hex
        while episode.active and episode.turns < self.max_turn:
            out = await self.server_manager.generate(request_id, prompt_ids=episode.prompt_ids(),
                                                     sampling_params=dict(params))
            ids = list(out.token_ids)
            finished = bool(ids) and ids[-1] in self.stop_ids
            episode.step(ids, self.tokenizer.decode(ids, skip_special_tokens=True), finished)
        fields = episode.output_fields()
        env_metrics = fields.pop("metrics")
        return AgentLoopOutput(**fields, num_turns=2 * episode.turns + 1, metrics=AgentLoopMetrics(),
                               extra_fields={"env_metrics": env_metrics})

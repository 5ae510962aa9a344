"""PPO's local backend hands pipelined turns (agent_proxy.pipeline_turns) to its generator."""

from __future__ import annotations

from SPA_agent.rollout.agent_proxy import LLMAgentProxy
from SPA_agent.trainer.local_backend.backend import LocalBackend


def test_the_local_backend_serves_pipelined_turns_with_the_static_decoder(ppo_config, tiny_tokenizer):
    """With the static decoder (the GPU default; CPU's is transformers' generate, which cannot) the PPO rollout
    runs pipelined, and its batch holds exactly the sampled ids of every turn."""
    cfg = ppo_config("_2_sokoban", "generator.decoder=static", "agent_proxy.pipeline_turns=true")
    backend = LocalBackend(cfg, tiny_tokenizer)
    proxy = LLMAgentProxy(cfg, backend, tiny_tokenizer)
    assert backend.can_serve and proxy.pipeline_turns
    rollout = proxy.rollout(val=False)
    batch = rollout.batch.batch
    for row, state in enumerate(rollout.states):
        sampled = [i for entry in state.history if "response_ids" in entry for i in entry["response_ids"]]
        assert batch["responses"][row][batch["response_mask"][row].bool()].tolist() == sampled
        assert 1 <= len(state.history) - 1 <= cfg.agent_proxy.max_turn
    assert not LocalBackend(ppo_config("_2_sokoban"), tiny_tokenizer).can_serve  # CPU default: generate

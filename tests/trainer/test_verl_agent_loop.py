"""The verl agent loop's pure parts (verl_episode.Episode) against the proxy's batch for the same trajectories."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from SPA_agent.config import compose
from SPA_agent.generators import build_generator
from SPA_agent.rollout.agent_proxy import LLMAgentProxy
from SPA_agent.rollout.turns import turns
from SPA_agent.trainer.verl_backend.episode import Episode, check_supported


@pytest.fixture(scope="module", params=["_2_sokoban", "_3_frozen_lake"])
def rollout(request, tiny_tokenizer, tiny_dir):
    cfg = compose(request.param, ["model=tiny", "generator=random"])
    proxy = LLMAgentProxy(cfg, build_generator(cfg.generator, str(tiny_dir), tiny_tokenizer), tiny_tokenizer)
    return OmegaConf.to_container(cfg, resolve=True), proxy.rollout(val=False), proxy.ctx.prefix


def _replay(config, tokenizer, state, prefix):
    """Feed one recorded trajectory's sampled turns to a fresh Episode; the prompt ids seen at each turn."""
    episode = Episode(config, tokenizer, state.tag, state.seed)
    prompts = []
    for turn in turns(state.history):
        prompts.append(episode.prompt_ids())
        episode.step(turn.response_ids, turn.llm_raw_response[len(prefix):], finished=True)
    return episode, prompts


def test_episode_gives_the_proxy_row_ids_masks_and_score(rollout, tiny_tokenizer):
    config, result, prefix = rollout
    batch = result.batch.batch
    for row, state in enumerate(result.states):
        episode, _ = _replay(config, tiny_tokenizer, state, prefix)
        out = episode.output_fields()
        real = batch["attention_mask"][row].bool()
        ids = batch["input_ids"][row][real].tolist()
        loss_mask = batch["loss_mask"][row][-(len(ids) - 1):].long().tolist()  # columns of tokens 1..L-1
        n = len(out["response_ids"])
        assert out["prompt_ids"] + out["response_ids"] == ids[: n + 1]
        assert out["response_mask"] == loss_mask[:n] and out["response_mask"][-1] == 1
        assert not any(loss_mask[n:]), "only untrained tokens are dropped"
        assert out["reward_score"] == pytest.approx(batch["rm_scores"][row].sum().item())
        per_env = {key: value for key, value in state.metrics.items() if "/pass@" not in key}  # a group statistic
        assert {key: out["metrics"][key] for key in per_env} == per_env


def test_each_turn_prompt_is_a_prefix_of_the_trained_sequence(rollout, tiny_tokenizer):
    """Token in, token out: what the server is asked to continue is exactly what the trainer scores."""
    config, result, prefix = rollout
    state = result.states[0]
    episode, prompts = _replay(config, tiny_tokenizer, state, prefix)
    out = episode.output_fields()
    sequence = out["prompt_ids"] + out["response_ids"]
    assert len(prompts) >= 1
    for prompt in prompts:
        assert sequence[: len(prompt)] == prompt


@pytest.mark.parametrize("override, message", [
    ({"reward_normalization": {"method": "mean_std", "grouping": "state"}}, "method=identity"),
    ({"use_turn_scores": True}, "use_turn_scores=False"),
])
def test_group_dependent_scores_are_refused(rollout, override, message):
    config = {**rollout[0], "agent_proxy": {**rollout[0]["agent_proxy"], **override}}
    with pytest.raises(ValueError, match=message):
        check_supported(config)


def test_agent_loop_registers_with_verl():
    pytest.importorskip("verl.experimental.agent_loop.agent_loop",
                        reason="verl's agent-loop module needs the GPU extras (cachetools, uvicorn, ...; come with vllm)")
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from SPA_agent.trainer.verl_backend.agent_loop import AGENT_NAME

    assert _agent_loop_registry[AGENT_NAME]["_target_"] == "SPA_agent.trainer.verl_backend.agent_loop.SPAEnvAgentLoop"

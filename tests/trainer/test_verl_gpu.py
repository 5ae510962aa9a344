"""verl backend on GPUs: the same batch through `local` and `verl` (skipped without ≥ 2 CUDA GPUs, ray and vllm).

Both backends start from the tiny model's weights, so old log-probs agree up to bf16 noise, and the first
actor update (one mini-batch, one epoch) reports the same pre-step PPO loss. The critics' value heads are
initialised independently, so values are compared only through the shared driver code (GAE on given values).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from SPA_agent.config import compose
from SPA_agent.generators import build_generator
from SPA_agent.rollout.agent_proxy import LLMAgentProxy
from SPA_agent.trainer import algos

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("ray") is None
                       or importlib.util.find_spec("vllm") is None,
                       reason="needs 2 CUDA GPUs with ray and vllm (pip install 'spa-agent[gpu]')"),
]


@pytest.fixture(scope="module")
def backends(tiny_tokenizer, tiny_dir):
    from SPA_agent.trainer.local_backend.backend import LocalBackend
    from SPA_agent.trainer.verl_backend.backend import VerlBackend

    cfg = compose("_2_sokoban", ["model=tiny", "generator=random", "trainer.backend=verl", "trainer.n_gpus_per_node=2",
                                 "trainer.device=cuda", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                 "critic.ppo_mini_batch_size=4"])
    proxy = LLMAgentProxy(cfg, build_generator(cfg.generator, str(tiny_dir), tiny_tokenizer), tiny_tokenizer)
    batch = proxy.rollout(val=False).batch
    rows, _ = algos.rollout_filter(batch.batch["rm_scores"], 2, 0.5, "std")
    batch = batch.select_idxs(rows.numpy())
    batch.batch["response_mask"] = batch.batch["loss_mask"].float()
    return cfg, LocalBackend(cfg, tiny_tokenizer), VerlBackend(cfg, tiny_tokenizer), batch


def test_old_log_probs_agree(backends):
    _, local, verl, batch = backends
    ours, theirs = local.compute_log_prob(batch), verl.compute_log_prob(batch)
    mask = batch.batch["response_mask"].bool()
    diff = (ours.batch["old_log_probs"] - theirs.batch["old_log_probs"])[mask].abs()
    assert diff.mean() < 0.02 and diff.max() < 0.2, (diff.mean(), diff.max())


def test_first_actor_update_reports_the_same_loss(backends):
    _, local, verl, batch = backends
    batch = batch.union(local.compute_log_prob(batch)).union(local.compute_values(batch))
    t = batch.batch
    t["advantages"], t["returns"] = algos.compute_advantages(t["rm_scores"], t["values"], t["response_mask"],
                                                             t["response_mask"], gamma=1.0, lam=1.0)
    ours, theirs = local.update_actor(batch), verl.update_actor(batch)
    assert theirs["actor/pg_loss"] == pytest.approx(ours["actor/pg_loss"], abs=2e-2)
    assert theirs["actor/entropy"] == pytest.approx(ours["actor/entropy"], rel=2e-2)


def test_generation_after_update_uses_the_servers(backends):
    _, _, verl, _ = backends
    cfg = compose("_2_sokoban", ["model=tiny"])
    from transformers import AutoTokenizer

    from SPA_agent.model_presets import resolve_model_path

    proxy = LLMAgentProxy(cfg, verl, AutoTokenizer.from_pretrained(resolve_model_path("tiny")))
    rollout = proxy.rollout(val=True)
    assert rollout.batch.batch["response_mask"].sum() > 0

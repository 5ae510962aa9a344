"""Trainer fixtures: small PPO configs on the tiny model and hand-made rollout batches with the rollout contract."""

from __future__ import annotations

import pytest
import torch
from verl import DataProto

from SPA_agent.config import compose

#: a PPO run small enough for CI: 2 groups × 2 envs, 2 turns of ≤ 16 tokens, one val group, CPU
TINY_PPO = [
    "model=tiny",
    "trainer.device=cpu",
    "es_manager.train.env_groups=2",
    "es_manager.train.env_configs.n_groups=[2]",
    "es_manager.val.env_groups=1",
    "es_manager.val.env_configs.n_groups=[1]",
    "agent_proxy.max_turn=2",
    "actor_rollout_ref.rollout.response_length=16",
    "ppo_mini_batch_size=2",
    "trainer.test_freq=2",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "critic.model.enable_gradient_checkpointing=False",
]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every trainer test on one torch thread (tests/conftest.py)."""


@pytest.fixture
def ppo_config(tmp_path):
    """Factory: a composed PPO config writing under tmp_path, with extra overrides."""

    def make(config_name: str = "_2_sokoban", *overrides: str):
        return compose(config_name, [*TINY_PPO, f"trainer.default_local_dir={tmp_path / 'run'}", *overrides])

    return make


@pytest.fixture
def make_batch(tiny_tokenizer):
    """Factory: a rollout-shaped batch of random tiny-vocabulary tokens (see `rollout_shaped_batch`)."""
    return lambda seed=0, rows=3, length=12: rollout_shaped_batch(len(tiny_tokenizer), rows, length, seed)


def rollout_shaped_batch(vocab_size: int, rows: int = 3, length: int = 12, seed: int = 0) -> DataProto:
    """A rollout-shaped batch: left padding on row 0, loss_mask on two spans, a terminal score per row."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (rows, length), generator=g)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    attention_mask[0, :3] = 0
    input_ids[0, :3] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    loss_mask = torch.zeros(rows, length - 1)
    loss_mask[:, 3:6] = 1
    loss_mask[:, 8:] = 1
    rm_scores = torch.zeros(rows, length - 1)
    rm_scores[:, -1] = torch.arange(rows, dtype=torch.float32)
    tensors = {
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
        "responses": input_ids[:, 1:], "response_mask": loss_mask.clone(), "loss_mask": loss_mask,
        "rm_scores": rm_scores,
    }
    return DataProto.from_dict(tensors=tensors)

"""The PPO step's critic lane: a backend whose critic has worker processes of its own (`concurrent_critic`,
verl_backend.separate_critic) gets its critic passes in a driver thread beside the actor's; any other backend gets
them at once, in the step's thread, with the same numbers either way."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from verl import DataProto

from SPA_agent.trainer.metrics import PhaseTimer
from SPA_agent.trainer.ppo_trainer import PPOTrainer, _view

ROWS, WIDTH = 4, 6


class _Rollout:
    def __init__(self, batch):
        self.batch, self.metrics = batch, {}


class _Proxy:
    def rollout(self, val):
        response_mask = torch.ones(ROWS, WIDTH - 1)
        rm_scores = torch.zeros(ROWS, WIDTH - 1)
        rm_scores[:, -1] = torch.arange(ROWS, dtype=torch.float32)
        batch = DataProto.from_dict(tensors={"rm_scores": rm_scores, "loss_mask": response_mask.clone(),
                                             "response_mask": response_mask,
                                             "attention_mask": torch.ones(ROWS, WIDTH, dtype=torch.long)},
                                    non_tensors={"group_ids": np.arange(ROWS) // 2, "seeds": np.arange(ROWS) // 2})
        return _Rollout(batch)


class _Backend:
    """Records which thread runs each pass. With `wait_for_actor`, each critic pass waits until the actor's pass
    beside it has started: it can only finish if the two run at the same time."""

    has_ref = False

    def __init__(self, concurrent_critic: bool, wait_for_actor: bool = False):
        self.concurrent_critic, self.wait_for_actor = concurrent_critic, wait_for_actor
        self.log_prob_started, self.update_started = threading.Event(), threading.Event()
        self.calls: list[tuple[str, str]] = []

    def _record(self, name: str) -> None:
        self.calls.append((name, threading.current_thread().name))

    def _wait(self, event: threading.Event) -> None:
        if self.wait_for_actor and not event.wait(timeout=20):
            raise TimeoutError("the actor's pass never ran beside the critic's")

    def compute_values(self, batch):
        self._record("values")
        self._wait(self.log_prob_started)
        assert "old_log_probs" not in batch.batch.keys()  # the view the step handed over, not the growing batch
        return DataProto.from_dict(tensors={"values": torch.full((ROWS, WIDTH - 1), 0.5)})

    def compute_log_prob(self, batch):
        self.log_prob_started.set()
        self._record("old_log_prob")
        return DataProto.from_dict(tensors={"old_log_probs": torch.zeros(ROWS, WIDTH - 1),
                                            "entropys": torch.ones(ROWS, WIDTH - 1)})

    def update_critic(self, batch):
        self._record("update_critic")
        self._wait(self.update_started)
        return {"critic/vf_loss": float(batch.batch["returns"].sum())}

    def update_actor(self, batch):
        self.update_started.set()
        self._record("update_actor")
        return {"actor/pg_loss": float(batch.batch["advantages"].sum())}

    def step_timings(self):
        return {}


def _step(ppo_config, backend):
    cfg = ppo_config("_2_sokoban", "actor_rollout_ref.rollout.rollout_filter_ratio=1", "es_manager.train.group_size=2",
                     "actor_rollout_ref.actor.use_ref=False")
    timer = PhaseTimer()
    metrics = PPOTrainer(cfg, backend, _Proxy(), logger=None).train_step(1, timer)
    return metrics, timer.seconds


def test_a_separate_critic_runs_its_passes_beside_the_actors(ppo_config):
    backend = _Backend(concurrent_critic=True, wait_for_actor=True)  # each critic pass finishes only beside the actor's
    metrics, seconds = _step(ppo_config, backend)
    threads = dict(backend.calls)
    assert threads["values"] == threads["update_critic"] != threads["old_log_prob"] == threads["update_actor"]
    assert threads["values"].startswith("critic") and threads["old_log_prob"] == threading.main_thread().name
    assert {"values", "old_log_prob", "adv", "update_critic", "update_actor"} <= set(seconds)
    assert {"critic/vf_loss", "actor/pg_loss"} <= set(metrics)


def test_a_fused_critic_runs_its_passes_at_once_with_the_same_numbers(ppo_config):
    serial, concurrent = _Backend(concurrent_critic=False), _Backend(concurrent_critic=True)
    serial_metrics, _ = _step(ppo_config, serial)
    concurrent_metrics, _ = _step(ppo_config, concurrent)
    main = threading.main_thread().name
    assert serial.calls == [("values", main), ("old_log_prob", main), ("update_critic", main), ("update_actor", main)]
    assert serial_metrics["critic/vf_loss"] == pytest.approx(concurrent_metrics["critic/vf_loss"])
    assert serial_metrics["actor/pg_loss"] == pytest.approx(concurrent_metrics["actor/pg_loss"])
    assert serial_metrics["critic/vf_loss"] != 0  # GAE returns from the critic's values and the scores


def test_a_critic_failure_reaches_the_step(ppo_config):
    backend = _Backend(concurrent_critic=True)
    backend.compute_values = lambda batch: (_ for _ in ()).throw(RuntimeError("critic worker died"))
    with pytest.raises(RuntimeError, match="critic worker died"):
        _step(ppo_config, backend)


def test_the_critics_view_keeps_its_keys_while_the_batch_grows():
    batch = DataProto.from_dict(tensors={"input_ids": torch.arange(6).view(2, 3)}, meta_info={"step": 1})
    view = _view(batch)
    batch.batch["old_log_probs"] = torch.zeros(2, 3)
    batch.meta_info["more"] = True
    assert list(view.batch.keys()) == ["input_ids"] and view.meta_info == {"step": 1}
    assert view.batch["input_ids"].data_ptr() == batch.batch["input_ids"].data_ptr()  # no copy of the tensors

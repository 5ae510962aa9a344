"""Runs sharing a GPU: each phase's peak memory (`memory_gb/<phase>`), the kept decode buffer freed after each
validation (actor_rollout_ref.rollout.release_after_validation) and a process's share of its GPU
(trainer.cuda_memory_fraction)."""

from __future__ import annotations

import pytest

from SPA_agent.config import compose
from SPA_agent.runs.dir_lock import DirLock
from SPA_agent.trainer.config_checks import check_config
from SPA_agent.trainer.main_ppo import build_trainer
from SPA_agent.trainer.metrics import PhaseTimer

GB = 2**30


class ScriptedMemory:
    """The allocator as `CudaMemory` reads it: `live` bytes now, and their peak since the last reset."""

    def __init__(self) -> None:
        self.live = self.peak_since_reset = 0

    def allocate(self, size: int) -> None:
        self.live += size
        self.peak_since_reset = max(self.peak_since_reset, self.live)

    def reset(self) -> None:
        self.peak_since_reset = self.live

    def peak(self) -> int:
        return self.peak_since_reset

    def reserved(self) -> int:
        return 7 * GB


def test_each_phase_reports_its_own_peak_and_an_enclosing_phase_the_highest_of_its_inner_ones():
    memory = ScriptedMemory()
    timer = PhaseTimer(memory=memory)
    with timer("step"):
        memory.allocate(1 * GB)  # before any inner phase: the step's
        with timer("gen"):
            memory.allocate(4 * GB)  # a KV buffer
            memory.allocate(-2 * GB)
        with timer("update_actor"):
            memory.allocate(1 * GB)
            memory.allocate(-1 * GB)
        memory.allocate(-3 * GB)
        with timer("testing"):
            memory.allocate(2 * GB)
            memory.allocate(-2 * GB)
    metrics = timer.metrics()
    assert {k: v for k, v in metrics.items() if k.startswith("memory_gb/")} == {
        "memory_gb/gen": 5.0, "memory_gb/update_actor": 4.0, "memory_gb/testing": 2.0, "memory_gb/step": 5.0,
        "memory_gb/reserved": 7.0}
    assert set(metrics) >= {"timing_s/step", "timing_s/gen"}


def test_no_memory_metrics_without_a_gpu():
    timer = PhaseTimer()
    with timer("gen"):
        pass
    assert list(timer.metrics()) == ["timing_s/gen"]


def kept_graphs_trainer(ppo_config, tmp_path, release: bool):
    cfg = ppo_config("_2_sokoban", "trainer.total_training_steps=1", "generator.decoder=static",
                     "actor_rollout_ref.rollout.keep_decode_graphs=true",
                     f"actor_rollout_ref.rollout.release_after_validation={release}",
                     f"trainer.default_local_dir={tmp_path / str(release)}")
    lock = DirLock(tmp_path / str(release))
    return build_trainer(cfg, lock), lock


def test_release_after_validation_frees_the_kept_decode_buffer_and_samples_the_same(ppo_config, tmp_path):
    """The validation's metrics and the next training rollout's are those of the run that keeps the buffer (the
    samples do not depend on it); the buffer is gone after validation and built again by the next call."""
    results = {}
    for release in (False, True):
        trainer, lock = kept_graphs_trainer(ppo_config, tmp_path, release)
        try:
            validation = trainer.validate()
            decoder = trainer.backend.generator._static
            held_after_validation = decoder._storage is not None
            rollout = trainer.proxy.rollout(val=False)
            results[release] = (validation, rollout.batch.batch["input_ids"].tolist(), held_after_validation,
                                decoder._storage is not None)
        finally:
            lock.release()
    (kept_val, kept_ids, kept_held, _), (freed_val, freed_ids, freed_held, rebuilt) = results[False], results[True]
    assert freed_val == kept_val and freed_ids == kept_ids
    assert kept_held and not freed_held and rebuilt


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.release_after_validation=true"],
     "frees the kept KV buffer of generator=hf with actor_rollout_ref.rollout.keep_decode_graphs=true"),
    (["actor_rollout_ref.rollout.release_after_validation=yes"],
     r"release_after_validation must be one of \(True, False\)"),
    (["trainer.cuda_memory_fraction=0"], "trainer.cuda_memory_fraction is the local backend's share"),
    (["trainer.cuda_memory_fraction=1.5"], r"trainer.cuda_memory_fraction must be"),
])
def test_the_sharing_settings_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_config(compose("_2_sokoban", ["model=tiny", *overrides]))


def test_the_sharing_settings_pass_where_they_apply():
    check_config(compose("_2_sokoban", ["model=smollm2-135m", "actor_rollout_ref.rollout.release_after_validation=true",
                                        "trainer.cuda_memory_fraction=0.32"]))

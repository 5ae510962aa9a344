"""Runs sharing a GPU: each phase's peak memory (`memory_gb/<phase>`) and a process's share of its GPU
(trainer.cuda_memory_fraction)."""

from __future__ import annotations

import pytest
import torch

from SPA_agent.config import compose
from SPA_agent.trainer.config_checks import check_config
from SPA_agent.trainer.local_backend.backend import limit_gpu_share
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


@pytest.mark.parametrize("overrides, message", [
    (["trainer.backend=verl", "trainer.cuda_memory_fraction=0.3"], "with trainer.backend=verl"),
    (["trainer.cuda_memory_fraction=0"], "trainer.cuda_memory_fraction is the local backend's share"),
    (["trainer.cuda_memory_fraction=1.5"], r"trainer.cuda_memory_fraction must be"),
])
def test_the_sharing_settings_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_config(compose("_2_sokoban", ["model=tiny", *overrides]))


def test_a_share_of_the_gpu_passes_on_the_local_backend():
    check_config(compose("_2_sokoban", ["model=smollm2-135m", "trainer.cuda_memory_fraction=0.3"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a share of a GPU needs a GPU")
def test_a_share_of_the_gpu_applies_to_an_unindexed_cuda_device():
    """`trainer.device=cuda` resolves to a device without an index, which torch's setter refused (lease 2)."""
    limit_gpu_share(torch.device("cuda"), 0.3)
    assert torch.cuda.get_per_process_memory_fraction(torch.cuda.current_device()) == pytest.approx(0.3)
    limit_gpu_share(torch.device("cuda"), 1.0)


def test_a_share_of_an_unindexed_cuda_device_is_set_on_the_current_gpu(monkeypatch):
    """Torch's setter takes an index or an indexed device only: `cuda` (trainer.device=cuda) goes as the current
    GPU's index, `cuda:1` as 1. (Records the calls: no GPU here; the test above runs the setter on one.)"""
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *args: calls.append(args))
    limit_gpu_share(torch.device("cuda"), 0.3)
    limit_gpu_share(torch.device("cuda", 1), 0.5)
    assert calls == [(0.3, 0), (0.5, 1)]

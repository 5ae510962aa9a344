"""Step metrics of the PPO driver (names as in verl's `compute_data_metrics`, spec §10.3 step 9) and timers."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from verl import DataProto
from verl.utils import torch_functional as verl_F


class CudaMemory:
    """The caching allocator's bytes on a CUDA device: the peak of live tensors since the last `reset`, and what
    the process holds (live tensors and its cache, which no other process on the GPU can use)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)


class PhaseTimer:
    """Wall-clock seconds per named phase, reported as `timing_s/<phase>`; `report(phase, seconds)`, when given,
    is called as each phase ends (PPO prints it to a redirected log, so a long step shows its progress).

    With `memory` (a `CudaMemory`), also the peak of live tensors during each phase, `memory_gb/<phase>` (an
    enclosing phase's includes its inner phases'), and the bytes the process holds when the metrics are read,
    `memory_gb/reserved`: what decides whether runs sharing a GPU fit on it."""

    def __init__(self, report: Callable[[str, float], None] | None = None, memory: CudaMemory | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.report = report
        self.memory = memory
        self.peaks: dict[str, int] = {}
        self._open_peaks: list[int] = []  # the peak so far of each open phase, innermost last

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        if self.memory is not None:  # the allocator's peak so far is the enclosing phase's; this one's starts
            if self._open_peaks:
                self._open_peaks[-1] = max(self._open_peaks[-1], self.memory.peak())
            self._open_peaks.append(0)
            self.memory.reset()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
            if self.memory is not None:
                self._close_peak(phase)
            if self.report is not None:
                self.report(phase, seconds)

    def _close_peak(self, phase: str) -> None:
        """The phase's peak: the allocator's since the last reset (its own or an inner phase's) and its running
        peak (its inner phases', and what it held before each of their resets). The enclosing phase's takes it."""
        peak = max(self.memory.peak(), self._open_peaks.pop())
        self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
        if self._open_peaks:
            self._open_peaks[-1] = max(self._open_peaks[-1], peak)

    def metrics(self) -> dict[str, float]:
        metrics = {f"timing_s/{phase}": seconds for phase, seconds in self.seconds.items()}
        if self.memory is not None:
            metrics.update({f"memory_gb/{phase}": peak / 2**30 for phase, peak in self.peaks.items()})
            metrics["memory_gb/reserved"] = self.memory.reserved() / 2**30
        return metrics


@contextmanager
def operator_table(title: str, rows: int = 25) -> Iterator[None]:
    """Profile the block (CPU, and CUDA where there is a GPU) and print `title` and its `rows` costliest operators
    by their own GPU time (CPU time without a GPU); the table's totals of self CPU and self CUDA time tell how long
    the GPU sat idle in the block. Its wall time then includes the profiler's overhead."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                      row_limit=rows, max_name_column_width=80)
    print(f"{title}\n{table}", flush=True)


class FullCollections:
    """Seconds this process spends in Python's full (generation 2) garbage collections while the context is open
    (`timing_s/gc_full` on the driver; `gc_full=` of a verl worker's timed calls). A full collection walks every
    tracked object the process holds, its libraries' included (about 0.2 s on a CPU for the imports of the verl
    backend alone), and lands in whichever phase allocates when it comes due; `trainer.gc_freeze` exempts the
    objects of start-up (`gc_heap`)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start: float | None = None

    def _on_collection(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_collection)


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def _masked_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    on = values[mask.bool()]
    if on.numel() == 0:
        return {}
    return {f"{prefix}/mean": verl_F.masked_mean(values, mask).item(), f"{prefix}/max": on.max().item(),
            f"{prefix}/min": on.min().item()}


def data_metrics(batch: DataProto) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of the (filtered) training batch.

    `critic/score` is the trajectory score (row sum of `token_level_scores`), `critic/rewards` the same after
    the KL penalty; advantages/returns/values are statistics over the trained positions (`response_mask`);
    `critic/vf_explained_var` = 1 − Var(returns − values) / Var(returns) over those positions (values and
    explained variance only when there is a critic).
    """
    t = batch.batch
    mask = t["response_mask"]
    metrics = {
        **_stats("critic/score", t["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", t["token_level_rewards"].sum(-1)),
        **_masked_stats("critic/advantages", t["advantages"], mask),
        **_masked_stats("critic/returns", t["returns"], mask),
        **_stats("response_length", t["assistant_mask"].sum(-1)),
        **_stats("loss_tokens", mask.sum(-1)),
        "rollout/old_log_prob": verl_F.masked_mean(t["old_log_probs"], mask).item(),
    }
    if "values" in t:
        metrics.update(_masked_stats("critic/values", t["values"], mask))
    if "values" in t and mask.sum() > 1:
        var_returns = verl_F.masked_var(t["returns"], mask)
        var_error = verl_F.masked_var(t["returns"] - t["values"], mask)
        metrics["critic/vf_explained_var"] = (1.0 - var_error / (var_returns + 1e-5)).item()
    if "ref_log_prob" in t:
        metrics["rollout/ref_log_prob"] = verl_F.masked_mean(t["ref_log_prob"], mask).item()
    return metrics


def prefixed(prefix: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """`{prefix}/{key}` for every key, e.g. rollout metrics as `train/SimpleSokoban/success`."""
    return {f"{prefix}/{key}": float(value) for key, value in metrics.items()}


def mean_metrics(runs: list[Mapping[str, float]]) -> dict[str, float]:
    """Per-key mean over repeated runs (keys missing from a run are averaged over the runs that have them)."""
    keys = {key for run in runs for key in run}
    return {key: sum(run[key] for run in runs if key in run) / sum(key in run for run in runs) for key in sorted(keys)}

"""Fixes to verl 0.9.1, applied in every Ray worker process (Ray's `worker_process_setup_hook`, see backend.py).

1. verl loads the critic's value model with `attn_implementation="flash_attention_2"` hard-coded
   (`verl.utils.model.load_valuehead_model`), so the critic cannot start where flash-attn is not installed,
   although the actor honours `model.override_config.attn_implementation`. The value model now loads with the
   attention implementation of its config (sdpa without flash-attn, see `config._derived`).
2. Without flash-attn's cross-entropy kernel, verl's `logprobs_from_logits` falls back to `logprobs_from_logits_v2`,
   which loops over the leading dimension to save memory. Its FSDP engine passes (tokens, vocab) logits, so that
   is one logsumexp (or log-softmax) per token, forward and backward: on two H100s the actor's log-prob passes and
   update took 5-9x the local backend's time (benchmarks/RESULTS.md, issue 28). `logprobs_from_logits` below does
   the same sum in chunks of rows.
3. Packed micro-batches (`use_remove_padding`) without flash-attn name `packing.PACKED_ATTENTION` as their
   attention (`config.attention_settings`), registered here; and SDPA leaves out cuDNN, which plans anew for
   every sequence length (`packing.avoid_cudnn_attention`, as the local backend does).
4. With trainer.gc_freeze (the driver sets `gc_heap.WORKER_GC_FREEZE_ENV` for the Ray job), each worker freezes its
   start-up objects once a model is built (`freeze_after_model_builds`): full garbage collections of a worker took
   0.6-0.9 s each and stalled every rank (`gc_heap`).

Diagnostics on request: SPA_VERL_LOG_DEVICES=1 (each worker's ranks and GPUs) and SPA_VERL_TIME_CALLS=1 (the
seconds of each call inside the workers, `time_worker_calls`).
"""

from __future__ import annotations

import functools
import inspect
import time
from contextlib import contextmanager, nullcontext

import torch

from SPA_agent.trainer.gc_heap import WORKER_GC_FREEZE_ENV, freeze_long_lived_objects
from SPA_agent.trainer.metrics import FullCollections, operator_table
from SPA_agent.trainer.packing import avoid_cudnn_attention, register_packed_attention

#: rows (tokens) per logsumexp in `logprobs_from_logits`: 2,048 × a 152k vocabulary is 1.2 GB of float32
LOGPROB_CHUNK_ROWS = 2048


def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's token-classification value model (one label), with the config's attention implementation."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
        attn_implementation=model_config._attn_implementation, trust_remote_code=trust_remote_code)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """log softmax(logits)[label] for logits (..., vocab) and labels (...), as verl's function of the same name
    (its `inplace_backward` only concerns flash-attn's kernel): the label's logit minus the logsumexp of its row,
    in float32, LOGPROB_CHUNK_ROWS rows at a time."""
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if flat_labels.numel() == 0:
        return flat_logits.new_zeros(labels.shape, dtype=torch.float32)
    return torch.cat([_label_logprobs(chunk, label) for chunk, label in
                      zip(flat_logits.split(LOGPROB_CHUNK_ROWS), flat_labels.split(LOGPROB_CHUNK_ROWS))]).reshape(labels.shape)


def _label_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return logits.gather(-1, labels[:, None]).squeeze(-1) - logits.logsumexp(-1)


def apply() -> None:
    import os

    import verl.utils.model as verl_model
    import verl.utils.torch_functional as verl_functional
    from verl.workers.engine.fsdp import transformer_impl

    verl_model.load_valuehead_model = load_valuehead_model
    register_packed_attention()
    avoid_cudnn_attention()
    if not verl_functional.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE:  # flash-attn's kernel is vectorised already
        verl_functional.logprobs_from_logits = transformer_impl.logprobs_from_logits = logprobs_from_logits
    if os.environ.get(WORKER_GC_FREEZE_ENV) == "1":
        freeze_after_model_builds()
    if os.environ.get("SPA_VERL_LOG_DEVICES") == "1":
        log_device_placement()
    if os.environ.get("SPA_VERL_TIME_CALLS") == "1":
        time_worker_calls(os.environ.get("SPA_VERL_PROFILE_CALL", ""))


#: the worker methods that build a model (class name → method): the actor's and reference's, the critic's
MODEL_BUILDS = {"ActorRolloutRefWorker": "init_model", "TrainingWorker": "reset"}


def frozen_after(method):
    """`method`, then `gc_heap.freeze_long_lived_objects()` (one line of how many objects, how long a full collection
    over them took); verl's dispatch attributes are kept."""
    @functools.wraps(method)
    def build_then_freeze(*args, **kwargs):
        result = method(*args, **kwargs)
        frozen, seconds = freeze_long_lived_objects()
        print(f"[spa gc] after {method.__qualname__}: froze {frozen:,} objects (a full collection over them took "
              f"{seconds:.2f} s)", flush=True)
        return result
    return build_then_freeze


def freeze_after_model_builds() -> None:
    """Every MODEL_BUILDS method freezes the worker's objects when it returns (trainer.gc_freeze)."""
    from verl.workers import engine_workers

    for class_name, name in MODEL_BUILDS.items():
        cls = getattr(engine_workers, class_name)
        setattr(cls, name, frozen_after(getattr(cls, name)))


#: worker methods the driver calls each step, timed with SPA_VERL_TIME_CALLS=1 (class name → methods)
TIMED_CALLS = {"ActorRolloutRefWorker": ("compute_log_prob", "compute_ref_log_prob", "update_actor", "update_weights"),
               "TrainingWorker": ("infer_batch", "train_mini_batch")}
#: which call of the method SPA_VERL_PROFILE_CALL names is profiled: the first ones pay compilation and warm-up
PROFILED_CALL = 3


def timed_call(method, label: str, profile: bool = False):
    """`method` (sync or async) printing, in the worker, `[spa worker seconds] <label> <wall s> thread_cpu=<s>
    gc_full=<s>`: its wall seconds, the CPU seconds of the thread that ran it (near the wall time when launching
    kernels bounds the pass, but a wait for the GPU that spins counts too; below it when the thread waits blocked,
    for the GIL for one) and the seconds of the process's full garbage collections meanwhile. verl's dispatch
    attributes are kept (functools.wraps). With `profile` (sync methods), its PROFILED_CALL-th call also prints its
    operator table (`metrics.operator_table`)."""
    calls = 0

    @contextmanager
    def reported():
        start, thread_start = time.perf_counter(), time.thread_time()
        try:
            with FullCollections() as collections:
                yield
        finally:
            print(f"[spa worker seconds] {label} {time.perf_counter() - start:.4f} "
                  f"thread_cpu={time.thread_time() - thread_start:.4f} gc_full={collections.seconds:.4f}", flush=True)

    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def timed_async(*args, **kwargs):
            with reported():
                return await method(*args, **kwargs)
        return timed_async

    @functools.wraps(method)
    def timed(*args, **kwargs):
        nonlocal calls
        calls += 1
        profiling = profile and calls == PROFILED_CALL
        with reported(), operator_table(f"[spa worker profile] {label}") if profiling else nullcontext():
            return method(*args, **kwargs)
    return timed


def time_worker_calls(profiled: str = "") -> None:
    """With SPA_VERL_TIME_CALLS=1: every call of TIMED_CALLS prints its seconds inside the worker, to set against
    the driver's `timing_s/<phase>_call` (the whole round trip) when a verl step is slower than its passes alone;
    `profiled` (SPA_VERL_PROFILE_CALL, e.g. `ActorRolloutRefWorker.compute_ref_log_prob`) names the one method
    whose PROFILED_CALL-th call prints its operator table."""
    from verl.workers import engine_workers

    for class_name, methods in TIMED_CALLS.items():
        cls = getattr(engine_workers, class_name)
        for name in methods:
            label = f"{class_name}.{name}"
            setattr(cls, name, timed_call(getattr(cls, name), label, profile=label == profiled))


def log_device_placement() -> None:
    """With SPA_VERL_LOG_DEVICES=1: each verl worker prints its ranks and visible GPUs as its models are built
    (what to look at when NCCL reports two ranks on one GPU)."""
    import os

    from verl.workers import engine_workers

    def logged(method):
        def wrapper(self, *args, **kwargs):
            import ray
            import torch

            keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")
            print(f"[spa devices] {type(self).__name__}.{method.__name__}: "
                  + " ".join(f"{k}={os.environ.get(k)}" for k in keys)
                  + f" current_device={torch.cuda.current_device()} count={torch.cuda.device_count()}"
                  + f" ray_gpus={ray.get_runtime_context().get_accelerator_ids().get('GPU')}", flush=True)
            return method(self, *args, **kwargs)
        return wrapper

    engine_workers.TrainingWorker.reset = logged(engine_workers.TrainingWorker.reset)
    engine_workers.ActorRolloutRefWorker.init_model = logged(engine_workers.ActorRolloutRefWorker.init_model)

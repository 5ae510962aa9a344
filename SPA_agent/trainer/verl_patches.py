"""Fixes to verl 0.9.1, applied in every Ray worker process (Ray's `worker_process_setup_hook`, see verl_backend).

1. verl loads the critic's value model with `attn_implementation="flash_attention_2"` hard-coded
   (`verl.utils.model.load_valuehead_model`), so the critic cannot start where flash-attn is not installed,
   although the actor honours `model.override_config.attn_implementation`. The value model now loads with the
   attention implementation of its config (sdpa without flash-attn, see `verl_config._derived`).
2. Without flash-attn's cross-entropy kernel, verl's `logprobs_from_logits` falls back to `logprobs_from_logits_v2`,
   which loops over the leading dimension to save memory. Its FSDP engine passes (tokens, vocab) logits, so that
   is one logsumexp (or log-softmax) per token, forward and backward: on two H100s the actor's log-prob passes and
   update took 5-9x the local backend's time (benchmarks/RESULTS.md, issue 28). `logprobs_from_logits` below does
   the same sum in chunks of rows.
3. Packed micro-batches (`use_remove_padding`) without flash-attn name `packing.PACKED_ATTENTION` as their
   attention (`verl_config.attention_settings`), registered here; and SDPA leaves out cuDNN, which plans anew for
   every sequence length (`packing.avoid_cudnn_attention`, as the local backend does).
4. verl's weight sync (`ActorRolloutRefWorker.update_weights`) empties the training process's CUDA cache before
   every rollout, so that the engine's KV cache finds the memory, whatever the model. Every pass of the next step
   then maps its memory anew (expandable segments). With `verl_backend.training_cache=auto` the cache stays where
   the GPU's free memory holds the engine's share beside it (`keeps_training_cache`), and is emptied as verl does
   where not.
"""

from __future__ import annotations

import functools

import torch

from SPA_agent.trainer.packing import avoid_cudnn_attention, register_packed_attention

#: environment variable carrying `verl_backend.training_cache` to the workers (verl_backend.ray_runtime_env)
TRAINING_CACHE_ENV = "SPA_VERL_TRAINING_CACHE"
#: what `verl_backend.training_cache` takes: keep the cache where the engine fits beside it, or verl's behaviour
TRAINING_CACHE_MODES = ("auto", "release")
#: free memory kept beyond the engine's share when the training cache stays (weight-sync buffers, allocator slack)
TRAINING_CACHE_HEADROOM_BYTES = 2 << 30

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


def keeps_training_cache(free_bytes: int, total_bytes: int, engine_share: float, engine_asleep: bool,
                         bucket_bytes: int) -> bool:
    """Whether the weight sync may leave the training cache in place: the GPU's free memory (measured with the
    engine asleep) holds what the engine takes back when it wakes (`engine_share` of the GPU; nothing when it never
    sleeps), the weight-sync buckets and TRAINING_CACHE_HEADROOM_BYTES."""
    engine = engine_share * total_bytes if engine_asleep else 0
    return free_bytes >= engine + bucket_bytes + TRAINING_CACHE_HEADROOM_BYTES


class CacheKeepingDevice:
    """Stands in for `torch.cuda` inside verl's engine_workers: all of it, but `empty_cache` does nothing while
    `keep` is set."""

    def __init__(self, device):
        self._device, self.keep, self.kept_last = device, False, None

    def __getattr__(self, name):
        return getattr(self._device, name)

    def empty_cache(self) -> None:
        if not self.keep:
            self._device.empty_cache()


def keep_training_cache_when_it_fits() -> None:
    """`update_weights` of verl's actor workers leaves this process's CUDA cache alone where the engine's memory
    fits beside it (`keeps_training_cache`). The expandable-segment switches around the sync stay: the buffers
    sent to the engine over CUDA IPC must not come from expandable segments, and PyTorch's allocator then takes
    only regular blocks from its cache."""
    from verl.workers import engine_workers

    device = CacheKeepingDevice(engine_workers.get_torch_device())
    engine_workers.get_torch_device = lambda: device
    worker = engine_workers.ActorRolloutRefWorker
    sync = worker.update_weights

    @functools.wraps(sync)
    async def update_weights(self, *args, **kwargs):
        rollout = self.config.rollout
        free, total = device.mem_get_info()
        keep = keeps_training_cache(free, total, float(rollout.gpu_memory_utilization), bool(rollout.free_cache_engine),
                                    int(rollout.checkpoint_engine.update_weights_bucket_megabytes) << 20)
        if keep != device.kept_last:  # the first sync, and whenever the decision turns
            print(f"[spa training cache] {'kept' if keep else 'emptied'} at the weight sync: {free / 2**30:.1f} of "
                  f"{total / 2**30:.1f} GiB free, the engine takes {rollout.gpu_memory_utilization} of the GPU",
                  flush=True)
        device.keep = device.kept_last = keep
        try:
            return await sync(self, *args, **kwargs)
        finally:
            device.keep = False

    worker.update_weights = update_weights


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
    if os.environ.get(TRAINING_CACHE_ENV, "release") == "auto":
        keep_training_cache_when_it_fits()
    if os.environ.get("SPA_VERL_LOG_DEVICES") == "1":
        log_device_placement()
    if os.environ.get("SPA_VERL_TIME_CALLS") == "1":
        time_worker_calls()


#: worker methods the driver calls each step, timed with SPA_VERL_TIME_CALLS=1 (class name → methods)
TIMED_CALLS = {"ActorRolloutRefWorker": ("compute_log_prob", "compute_ref_log_prob", "update_actor", "update_weights"),
               "TrainingWorker": ("infer_batch", "train_mini_batch")}


def timed_call(method, label: str):
    """`method` (sync or async) printing its wall seconds in the worker as `[spa worker seconds] <label> <s>`; verl's
    dispatch attributes are kept (functools.wraps)."""
    import inspect
    import time

    def report(start):
        print(f"[spa worker seconds] {label} {time.perf_counter() - start:.4f}", flush=True)

    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def timed_async(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            finally:
                report(start)
        return timed_async

    @functools.wraps(method)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            report(start)
    return timed


def time_worker_calls() -> None:
    """With SPA_VERL_TIME_CALLS=1: every call of TIMED_CALLS prints its seconds inside the worker, to set against
    the driver's `timing_s/<phase>_call` (the whole round trip) when a verl step is slower than its passes alone."""
    from verl.workers import engine_workers

    for class_name, methods in TIMED_CALLS.items():
        cls = getattr(engine_workers, class_name)
        for name in methods:
            setattr(cls, name, timed_call(getattr(cls, name), f"{class_name}.{name}"))


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

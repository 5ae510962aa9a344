"""A fix to verl 0.9.1, applied in every Ray worker process (Ray's `worker_process_setup_hook`, see verl_backend).

verl loads the critic's value model with `attn_implementation="flash_attention_2"` hard-coded
(`verl.utils.model.load_valuehead_model`), so the critic cannot start where flash-attn is not installed, although
the actor honours `model.override_config.attn_implementation`. `apply` makes the value model load with the
attention implementation of its config instead (sdpa without flash-attn, see `verl_config._derived`).
"""

from __future__ import annotations


def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's token-classification value model (one label), with the config's attention implementation."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
        attn_implementation=model_config._attn_implementation, trust_remote_code=trust_remote_code)


def apply() -> None:
    import os

    import verl.utils.model as verl_model

    verl_model.load_valuehead_model = load_valuehead_model
    if os.environ.get("SPA_VERL_LOG_DEVICES") == "1":
        log_device_placement()


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

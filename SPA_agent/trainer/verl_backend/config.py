"""Our composed Hydra config → the config verl's Ray/FSDP workers and vLLM/SGLang rollout read.

The base is verl's own flattened default (`verl/trainer/config/_generated_ppo_trainer.yaml`, what verl's Hydra
composition of `ppo_trainer` gives), so every key verl's workers look up exists with verl's default. On top of
it go our values: the `COPIED` table (same meaning, our path → verl's path), the derived keys of `_derived`, and
last `verl_backend.verl_config`, verl keys a user sets directly. verl's own checks
(`verl.utils.config.validate_config`, which builds its typed ActorConfig, CriticConfig and checks batch
divisibility) then run on the result.

Shapes the workers see: the filtered batch of `int(rollout_filter_ratio × env_groups) × group_size`
trajectories (verl's `data.train_batch_size`), split evenly over `n_gpus_per_node × nnodes` data-parallel ranks.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from SPA_agent.trainer.packing import PACKED_ATTENTION

#: extra to install for this backend
INSTALL_HINT = "pip install 'spa-agent[gpu]'"
#: rollout engines verl serves in its hybrid (colocated) mode
ROLLOUT_ENGINES = ("vllm", "sglang")

_ACTOR, _ROLLOUT, _CRITIC = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"

#: LoRA settings of a model (actor_rollout_ref.model, critic.model): the same keys in both configs
LORA_KEYS = ("lora_rank", "lora_alpha", "target_modules", "exclude_modules")

#: (our key, verl key): values copied unchanged
COPIED: tuple[tuple[str, str], ...] = (
    *((f"{model}.{k}",) * 2 for model in ("actor_rollout_ref.model", f"{_CRITIC}.model") for k in LORA_KEYS),
    *((f"actor_rollout_ref.model.{k}",) * 2 for k in ("enable_gradient_checkpointing",)),
    *((f"{_ACTOR}.{k}",) * 2 for k in (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "shuffle", "grad_clip", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "loss_scale_factor",
        "policy_loss.loss_mode", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type",
        "optim.lr", "optim.lr_warmup_steps_ratio", "optim.weight_decay", "optim.betas")),
    (f"{_ACTOR}.grad_clip", f"{_ACTOR}.optim.clip_grad"),
    *((f"actor_rollout_ref.ref.{k}",) * 2 for k in (
        "log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")),
    ("actor_rollout_ref.ref.offload_to_cpu", "actor_rollout_ref.ref.fsdp_config.param_offload"),
    *((f"{_ROLLOUT}.{k}",) * 2 for k in (
        "temperature", "top_k", "top_p", "dtype", "gpu_memory_utilization", "max_model_len", "max_num_batched_tokens",
        "max_num_seqs", "log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu",
        "response_length", "val_kwargs.top_k", "val_kwargs.top_p", "val_kwargs.temperature", "val_kwargs.do_sample")),
    *((f"{_CRITIC}.{k}",) * 2 for k in (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "forward_max_token_len_per_gpu", "ppo_epochs", "shuffle", "grad_clip", "cliprange_value", "loss_agg_mode", "model.enable_gradient_checkpointing",
        "optim.lr", "optim.lr_warmup_steps_ratio", "optim.weight_decay", "optim.betas")),
    (f"{_CRITIC}.grad_clip", f"{_CRITIC}.optim.clip_grad"),
    # the value pass's token budget (verl's critic engine reads it under this name)
    (f"{_CRITIC}.forward_max_token_len_per_gpu", f"{_CRITIC}.ppo_infer_max_token_len_per_gpu"),
    *((f"algorithm.{k}",) * 2 for k in (
        "gamma", "lam", "adv_estimator", "use_kl_in_reward", "kl_penalty", "kl_ctrl.type", "kl_ctrl.kl_coef")),
    *((f"trainer.{k}",) * 2 for k in (
        "n_gpus_per_node", "nnodes", "project_name", "experiment_name", "total_training_steps", "critic_warmup",
        "default_local_dir", "max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep")),
    *((f"verl_backend.{k}", f"{_ROLLOUT}.{k}") for k in ("enforce_eager", "load_format")),
    ("verl_backend.rollout_name", f"{_ROLLOUT}.name"),
)

#: verl checkpoint contents: sharded model + optimizer + RNG, plus a Hugging Face export (`<role>/huggingface`)
CHECKPOINT_CONTENTS = ["model", "optimizer", "extra", "hf_model"]


def verl_defaults() -> DictConfig:
    """verl's full default PPO config (the flattened `ppo_trainer` composition shipped with verl); a fresh copy."""
    return copy.deepcopy(_load_verl_defaults())


@functools.lru_cache(maxsize=1)
def _load_verl_defaults() -> DictConfig:
    import verl

    return OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")


def filtered_batch_size(cfg: DictConfig) -> int:
    """Trajectories per PPO step after the StarPO-S filter (what the workers train on)."""
    rollout, train = cfg.actor_rollout_ref.rollout, cfg.es_manager.train
    ratio = rollout.rollout_filter_ratio
    groups = train.env_groups if ratio >= 1 else int(ratio * train.env_groups)
    return groups * train.group_size


def attention_settings(has_flash_attn: bool, remove_padding: str | bool = "auto") -> dict[str, object]:
    """Attention of the actor, reference and critic models (verl path → value) and whether their micro-batches are
    packed (`use_remove_padding`, per `verl_backend.remove_padding`: `auto` and `True` pack, `False` pads).

    With `use_remove_padding`, verl's FSDP engine (`FSDPEngine.prepare_model_inputs`) concatenates a micro-batch's
    sequences into one row with restarting `position_ids`, no attention mask and `use_cache=False`; its unpad
    helpers fall back to plain torch without flash-attn (`verl.utils.attention_utils`). The attention reads the
    sequence boundaries from the position ids: flash-attn's variable-length kernel where flash-attn is installed,
    else `packing.PACKED_ATTENTION` (one causal SDPA call per sequence, registered in every worker by
    `patches.py`). transformers' own sdpa would build a dense (L, L) block-diagonal mask and attend over all of
    it. Padded micro-batches use flash_attention_2 or sdpa.
    """
    if remove_padding not in ("auto", True, False):
        raise ValueError(f"verl_backend.remove_padding must be auto, true or false, got {remove_padding!r}")
    packed = remove_padding in ("auto", True)
    attention = "flash_attention_2" if has_flash_attn else PACKED_ATTENTION if packed else "sdpa"
    return {f"{model}.{key}": value for model in ("actor_rollout_ref.model", f"{_CRITIC}.model")
            for key, value in (("override_config.attn_implementation", attention), ("use_remove_padding", packed))}


def rollout_tensor_parallel(setting: int | str, *, weight_bytes: int, gpu_bytes: int | None,
                            memory_share: float, gpus: int, attention_heads: int) -> int:
    """GPUs per rollout engine (`actor_rollout_ref.rollout.tensor_model_parallel_size`); a number is kept.

    `auto`: the fewest GPUs (dividing the GPU count and the model's attention heads) whose slice of the weights
    takes at most half of the memory the engine may use (`memory_share` of a GPU), the other half left for the KV
    cache and CUDA graphs. A model that fits one GPU so runs one engine per GPU: data-parallel replicas that decode
    without an all-reduce per layer. Without a GPU on the driver (`gpu_bytes` None) it is 1.
    """
    if setting != "auto":
        return int(setting)
    if gpu_bytes is None:
        return 1
    fits = [tp for tp in range(1, gpus + 1) if gpus % tp == 0 and attention_heads % tp == 0]
    return next((tp for tp in fits if weight_bytes / tp <= memory_share * gpu_bytes / 2), fits[-1])


#: bytes per parameter a trained model keeps on its GPUs between passes, sharded by FSDP: float32 weights,
#: gradients and Adam's two moments
TRAINED_BYTES_PER_PARAMETER = 16


def free_cache_engine(setting: bool | str, *, parameters: int, gpu_bytes: int | None, memory_share: float,
                      gpus: int, has_ref: bool) -> bool:
    """Whether the rollout engines hand their memory back while the models train (verl's `free_cache_engine`);
    a boolean is kept.

    `auto`: keep them resident (False) when what the training keeps on each GPU between passes (actor and critic
    with their optimizer states, and the bfloat16 reference, all sharded over `gpus`) takes at most half of the
    memory the engine leaves (1 − `memory_share` of a GPU), the other half left for activations. A resident engine
    skips the sleep before the first pass and the wake-up before generating, and the first pass does not allocate
    anew (0.5B on 2× H200: 1.2 s a step, benchmarks/RESULTS.md). Without a GPU on the driver (`gpu_bytes` None)
    it is True.
    """
    if setting not in ("auto", True, False):
        raise ValueError(f"verl_backend.free_cache_engine must be auto, true or false, got {setting!r}")
    if setting != "auto":
        return setting
    if gpu_bytes is None:
        return True
    kept = parameters * (2 * TRAINED_BYTES_PER_PARAMETER + (2 if has_ref else 0)) / gpus
    return kept > (1 - memory_share) * gpu_bytes / 2


@functools.lru_cache(maxsize=8)
def model_parameters(path: str) -> tuple[int, int]:
    """(the model's parameters, its attention heads), counted once per path on the meta device: nothing is read but
    the config (both `auto` settings of the rollout ask)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), config.num_attention_heads


def model_weight_bytes(path: str, dtype: str) -> tuple[int, int]:
    """(bytes of the model's weights in `dtype`, its attention heads)."""
    parameters, heads = model_parameters(path)
    return parameters * torch.finfo(getattr(torch, dtype)).bits // 8, heads


def _gpu_bytes() -> int | None:
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _rollout_tp(cfg: DictConfig, model_path: str) -> int:
    rollout, trainer = cfg.actor_rollout_ref.rollout, cfg.trainer
    if rollout.tensor_model_parallel_size != "auto":
        return int(rollout.tensor_model_parallel_size)
    weights, heads = model_weight_bytes(model_path, rollout.dtype)
    return rollout_tensor_parallel("auto", weight_bytes=weights, gpu_bytes=_gpu_bytes(),
                                   memory_share=rollout.gpu_memory_utilization,
                                   gpus=trainer.n_gpus_per_node * trainer.nnodes, attention_heads=heads)


def _free_cache_engine(cfg: DictConfig, model_path: str) -> bool:
    return free_cache_engine(cfg.verl_backend.free_cache_engine, parameters=model_parameters(model_path)[0],
                             gpu_bytes=_gpu_bytes(),
                             memory_share=cfg.actor_rollout_ref.rollout.gpu_memory_utilization,
                             gpus=cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes,
                             has_ref=bool(cfg.actor_rollout_ref.actor.use_ref))


def _derived(cfg: DictConfig) -> dict[str, object]:
    """verl keys computed from ours (verl path → value)."""
    from SPA_agent.model_presets import resolve_model_path

    actor_path = resolve_model_path(cfg.actor_rollout_ref.model.path)
    critic_path = resolve_model_path(cfg.critic.model.path)
    context = cfg.actor_rollout_ref.rollout.max_model_len
    steps = cfg.trainer.total_training_steps
    return {
        **attention_settings(importlib.util.find_spec("flash_attn") is not None, cfg.verl_backend.remove_padding),
        "actor_rollout_ref.model.path": actor_path,
        f"{_CRITIC}.model.path": critic_path,
        f"{_ROLLOUT}.tensor_model_parallel_size": _rollout_tp(cfg, actor_path),
        f"{_ROLLOUT}.free_cache_engine": _free_cache_engine(cfg, actor_path),
        f"{_CRITIC}.model.tokenizer_path": actor_path,
        f"{_CRITIC}.enable": True,
        f"{_ACTOR}.optim.total_training_steps": steps,
        f"{_CRITIC}.optim.total_training_steps": steps,
        f"{_ACTOR}.checkpoint.save_contents": CHECKPOINT_CONTENTS,
        f"{_CRITIC}.checkpoint.save_contents": CHECKPOINT_CONTENTS,
        # a multi-turn prompt may fill the whole context; each turn adds at most response_length tokens
        f"{_ROLLOUT}.prompt_length": context,
        "data.max_prompt_length": context,
        "data.max_response_length": cfg.actor_rollout_ref.rollout.response_length,
        "data.train_batch_size": filtered_batch_size(cfg),
        # the driver recomputes old log-probs with the actor; the engine need not return its own
        f"{_ROLLOUT}.calculate_log_probs": False,
        f"{_ROLLOUT}.n": 1,
        # a LoRA actor's weights reach the engine merged into the base ones (no adapter support needed there)
        "actor_rollout_ref.model.lora.merge": cfg.actor_rollout_ref.model.lora_rank > 0,
        "trainer.device": "cuda",
        "trainer.logger": ["console"],
    }


def build_verl_config(cfg: DictConfig) -> DictConfig:
    """The full verl config for `cfg` (resolved, so it can travel to Ray workers as is)."""
    verl_cfg = verl_defaults()
    for ours, theirs in COPIED:
        value = OmegaConf.select(cfg, ours, throw_on_missing=True)
        OmegaConf.update(verl_cfg, theirs, value, merge=False, force_add=True)
    for theirs, value in _derived(cfg).items():
        OmegaConf.update(verl_cfg, theirs, value, merge=False, force_add=True)
    verl_cfg = OmegaConf.merge(verl_cfg, cfg.verl_backend.get("verl_config") or {})
    OmegaConf.resolve(verl_cfg)
    return verl_cfg


#: vLLM's switch between its two model runners; unset, vLLM picks by architecture (verl_backend.vllm_model_runner)
VLLM_MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
VLLM_MODEL_RUNNERS = ("auto", "v1", "v2")


def model_runner_env(model_runner: str) -> dict[str, str]:
    """verl_backend.vllm_model_runner → the engines' environment. `auto` leaves vLLM's choice: its V2 runner
    (input preparation on the GPU, less CPU work per decoding step) for the architectures it lists (Llama, Qwen3,
    ...), V1 for the others (Qwen2 among them); `v1` / `v2` force one."""
    if model_runner not in VLLM_MODEL_RUNNERS:
        raise ValueError(f"verl_backend.vllm_model_runner must be one of {list(VLLM_MODEL_RUNNERS)}, got "
                         f"{model_runner!r}")
    return {} if model_runner == "auto" else {VLLM_MODEL_RUNNER_ENV: "1" if model_runner == "v2" else "0"}


def check_verl_config(cfg: DictConfig, verl_cfg: DictConfig) -> None:
    """Our checks with messages naming our keys, then verl's own `validate_config`; ValueError on failure."""
    backend = cfg.verl_backend
    if backend.rollout_name not in ROLLOUT_ENGINES:
        raise ValueError(f"verl_backend.rollout_name must be one of {list(ROLLOUT_ENGINES)}, got "
                         f"{backend.rollout_name!r}")
    model_runner_env(backend.vllm_model_runner)
    niceness = backend.worker_niceness
    if niceness is not None and (isinstance(niceness, bool) or not isinstance(niceness, int)
                                 or not 0 <= niceness <= 19):
        raise ValueError(f"verl_backend.worker_niceness must be null or a nice value from 0 to 19, got {niceness!r}")
    for key in ("worker_cpu_threads", "driver_cpu_threads"):
        threads = backend[key]
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"verl_backend.{key} must be null or a number of threads ≥ 1, got {threads!r}")
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    tp = verl_cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if world % tp:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size ({tp}) must divide the number of "
                         f"GPUs, trainer.n_gpus_per_node × trainer.nnodes ({world})")
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    if actor.use_dynamic_bsz != rollout.log_prob_use_dynamic_bsz:
        raise ValueError(f"actor_rollout_ref.actor.use_dynamic_bsz ({actor.use_dynamic_bsz}) and "
                         f"actor_rollout_ref.rollout.log_prob_use_dynamic_bsz ({rollout.log_prob_use_dynamic_bsz}) "
                         "must be equal: verl's actor worker runs both passes with one engine setting")
    batch = filtered_batch_size(cfg)
    for name in (_ACTOR, _CRITIC):
        mini = OmegaConf.select(cfg, f"{name}.ppo_mini_batch_size")
        if mini % world or batch % mini:
            raise ValueError(f"{name}.ppo_mini_batch_size ({mini}) must be a multiple of the {world} GPUs and "
                             f"divide the filtered batch ({batch} trajectories per step)")
    from verl.utils.config import validate_config

    try:
        validate_config(verl_cfg, use_reference_policy=bool(cfg.actor_rollout_ref.actor.use_ref), use_critic=True)
    except AssertionError as err:
        raise ValueError(f"verl rejected the translated config: {err}") from err

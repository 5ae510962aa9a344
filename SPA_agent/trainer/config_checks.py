"""Checks of a composed PPO config before any model is loaded (spec §10.1), each with a message saying what to set."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from verl.trainer.ppo import core_algos

from SPA_agent.entry import check_choice, check_list, check_number, check_numbers, check_rollout_settings
from SPA_agent.generators.split_kv_decode import SETTINGS as DECODE_ATTENTION
from SPA_agent.rollout.parsing import MODES as PROMPT_MODES
from SPA_agent.trainer.algos import ADV_ESTIMATORS, ROLLOUT_FILTERS
from SPA_agent.trainer.backend import BACKENDS

RESUME_MODES = ("auto", "disable")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


#: numbers the trainer reads, `(key, low, high, integer)`: a string or a value out of range is one line naming the
#: key before any model is loaded (an `lr=abc` used to fail in the optimizer, after the models were built)
NUMBERS = (
    ("trainer.n_gpus_per_node", 1, None, True), ("trainer.nnodes", 1, None, True), ("trainer.seed", 0, None, True),
    ("trainer.save_freq", -1, None, True), ("trainer.test_freq", -1, None, True),
    ("trainer.validation_steps", 0, None, True), ("trainer.critic_warmup", 0, None, True),
    ("trainer.max_actor_ckpt_to_keep", 1, None, True), ("trainer.max_critic_ckpt_to_keep", 1, None, True),
    *((f"{role}.{key}", low, high, integer) for role in ("actor_rollout_ref.actor", "critic") for key, low, high, integer in (
        ("ppo_mini_batch_size", 1, None, True), ("ppo_micro_batch_size_per_gpu", 1, None, True),
        ("ppo_max_token_len_per_gpu", 1, None, True), ("ppo_epochs", 1, None, True), ("grad_clip", 0, None, False),
        ("optim.lr", 0, None, False), ("optim.weight_decay", 0, None, False),
        ("optim.lr_warmup_steps_ratio", 0, 1, False))),
    ("critic.cliprange_value", 0, None, False),
    *((f"actor_rollout_ref.actor.{key}", 0, None, False) for key in (
        "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "kl_loss_coef")),
    ("actor_rollout_ref.actor.entropy_coeff", float("-inf"), None, False),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", 1, None, True),
    ("actor_rollout_ref.rollout.rollout_filter_ratio", 0, 1, False),
    ("actor_rollout_ref.rollout.temperature", 0, None, False), ("actor_rollout_ref.rollout.top_p", 0, 1, False),
    ("algorithm.gamma", 0, 1, False), ("algorithm.lam", 0, 1, False), ("algorithm.high_level_gamma", 0, 1, False),
    ("algorithm.kl_ctrl.kl_coef", 0, None, False),
    ("trainer.diagnostics.mi_freq", 0, None, True), ("trainer.diagnostics.mi_samples", 0, None, True),
    ("trainer.diagnostics.kl_freq", 0, None, True),
    ("trainer.max_wall_s", 0, None, False), ("trainer.cuda_memory_fraction", 0, 1, False),
    ("trainer.stop_after_uniform_scores", 1, None, True), ("trainer.log_val_generations", 0, None, True),
    ("actor_rollout_ref.actor.sft_aux_coef", 0, None, False), ("actor_rollout_ref.actor.sft_aux_rows", 1, None, True),
    ("generator.prefill_chunk_tokens", 1, None, True), ("generator.compact_decode_rows", 0, None, True),
)


def check_config(cfg: DictConfig) -> None:
    """Raise ValueError naming the offending keys if the config cannot train."""
    check_rollout_settings(cfg)
    _check_types(cfg)
    check_choice(cfg, "ctx_manager.mode", PROMPT_MODES)
    check_choice(cfg, "actor_rollout_ref.model.use_liger", (True, False, "auto"))
    check_choice(cfg, "actor_rollout_ref.model.liger_training", (True, False, "auto"))
    check_choice(cfg, "agent_proxy.pipeline_turns", (True, False))
    if OmegaConf.select(cfg, "generator.name") == "hf":
        check_choice(cfg, "generator.decode_attention", DECODE_ATTENTION)
        check_choice(cfg, "generator.fused_projections", (True, False, "auto"))
        check_choice(cfg, "generator.keep_decode_graphs", (True, False))
        check_choice(cfg, "generator.reuse_prefix_cache", (True, False))
        if cfg.generator.reuse_prefix_cache and not (cfg.agent_proxy.pipeline_turns
                                                     or cfg.generator.keep_decode_graphs):
            raise ValueError("generator.reuse_prefix_cache=true turn by turn keeps each chat's keys in the kept KV "
                             "buffer: add actor_rollout_ref.rollout.keep_decode_graphs=true (or "
                             "agent_proxy.pipeline_turns=true), or drop it: as set it would do nothing")
    _check_backend(cfg)
    _check_sft_aux(cfg)
    _check_batch_sizes(cfg)
    _check_algorithm(cfg)
    _check_trainer(cfg)


def _check_types(cfg: DictConfig) -> None:
    """Every number in NUMBERS, the optimizers' betas and the loggers, before the checks below compute with them."""
    check_numbers(cfg, NUMBERS)
    for role in ("actor_rollout_ref.actor", "critic"):
        if len(betas := check_list(cfg, f"{role}.optim.betas", float, "[0.9,0.999]")) != 2:
            raise ValueError(f"{role}.optim.betas must hold two numbers, got {betas}")
    check_list(cfg, "trainer.logger", str, "[console]")


def _check_backend(cfg: DictConfig) -> None:
    backend = cfg.trainer.backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown trainer.backend {backend!r}; choose one of {sorted(BACKENDS)}")
    if backend == "verl" and OmegaConf.select(cfg, "actor_rollout_ref.model.liger_training") is True:
        raise ValueError("actor_rollout_ref.model.liger_training=true is the local backend's switch; the verl backend's "
                         "workers do not read it: set actor_rollout_ref.model.liger_training=false")
    if backend == "local" and cfg.trainer.n_gpus_per_node != 1:
        raise ValueError(
            f"trainer.backend=local runs on one device but trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node}; "
            "set trainer.n_gpus_per_node=1"
        )


def _check_sft_aux(cfg: DictConfig) -> None:
    """PPO-ptx (actor.sft_aux_coef > 0): the local backend, rows >= 1 and SFT data files named (that they exist is
    `check_sft_aux_files`'s: a pipeline checks its PPO settings before its data stage has written them)."""
    coef = OmegaConf.select(cfg, "actor_rollout_ref.actor.sft_aux_coef", default=0.0)
    if coef is None:
        raise ValueError("actor_rollout_ref.actor.sft_aux_coef must be a number >= 0 (0 = off), got None")
    if coef == 0:
        return
    if cfg.trainer.backend != "local":
        raise ValueError("actor_rollout_ref.actor.sft_aux_coef > 0 (the SFT loss during PPO) runs on trainer.backend=local "
                         "only; set actor_rollout_ref.actor.sft_aux_coef=0 with trainer.backend=verl")
    check_number(cfg, "actor_rollout_ref.actor.sft_aux_rows", 1, integer=True)
    files = _sft_aux_files(cfg)
    if not files or not all(isinstance(f, str) for f in files):
        raise ValueError("actor_rollout_ref.actor.sft_aux_coef > 0 needs the SFT data: set "
                         "actor_rollout_ref.actor.sft_aux_files=[<dir>/wm_train.parquet]")


def _sft_aux_files(cfg: DictConfig) -> list | None:
    """actor.sft_aux_files as a list (one path or a list of them); None when it is neither."""
    files = OmegaConf.select(cfg, "actor_rollout_ref.actor.sft_aux_files")
    return [files] if isinstance(files, str) else list(files) if OmegaConf.is_list(files) else None


def check_sft_aux_files(cfg: DictConfig) -> None:
    """With actor.sft_aux_coef > 0, every file of actor.sft_aux_files exists (a PPO run checks it before loading
    its models; `check_config` has checked that they are named)."""
    if not cfg.actor_rollout_ref.actor.get("sft_aux_coef"):
        return
    missing = [f for f in _sft_aux_files(cfg) if not Path(f).is_file()]
    if missing:
        raise ValueError(f"actor_rollout_ref.actor.sft_aux_files: {missing[0]} does not exist (make it with python -m "
                         "SPA_agent.generate_sft_data, or fix the path)")


def _check_batch_sizes(cfg: DictConfig) -> None:
    n_gpus = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes  # every data-parallel rank, all nodes
    rollout, train = cfg.actor_rollout_ref.rollout, cfg.es_manager.train
    ratio = rollout.rollout_filter_ratio
    if not 0 < ratio <= 1:
        raise ValueError(f"actor_rollout_ref.rollout.rollout_filter_ratio must be in (0, 1], got {ratio}")
    kept_groups = train.env_groups if ratio >= 1 else int(ratio * train.env_groups)
    if kept_groups < 1:
        raise ValueError(
            f"rollout_filter_ratio={ratio} keeps no group out of es_manager.train.env_groups={train.env_groups}"
        )
    kept = kept_groups * train.group_size
    for name, role in (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor), ("critic", cfg.critic)):
        mini, micro = role.ppo_mini_batch_size, role.ppo_micro_batch_size_per_gpu
        # with token budgets (use_dynamic_bsz) the micro-batches are cut by tokens, not by this count
        if not role.use_dynamic_bsz and (micro * n_gpus > mini or mini % (micro * n_gpus)):
            raise ValueError(
                f"{name}.ppo_micro_batch_size_per_gpu ({micro}) × n_gpus ({n_gpus}) must be ≤ and divide "
                f"{name}.ppo_mini_batch_size ({mini}); lower micro_batch_size_per_gpu or change ppo_mini_batch_size"
            )
        if cfg.trainer.backend == "verl" and mini % n_gpus:
            raise ValueError(
                f"{name}.ppo_mini_batch_size ({mini}) must be a multiple of the {n_gpus} GPUs (trainer.n_gpus_per_node "
                f"{cfg.trainer.n_gpus_per_node} × trainer.nnodes {cfg.trainer.nnodes}): the verl backend gives every GPU "
                "an equal share of each mini-batch; change ppo_mini_batch_size or the number of GPUs"
            )
        if kept < mini or kept % mini:
            raise ValueError(
                f"the filtered batch has {kept} trajectories (int(rollout_filter_ratio {ratio} × env_groups "
                f"{train.env_groups}) × group_size {train.group_size}), which {name}.ppo_mini_batch_size ({mini}) "
                "must divide into whole mini-batches; change ppo_mini_batch_size or env_groups / rollout_filter_ratio"
            )


def _check_algorithm(cfg: DictConfig) -> None:
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    if "old_log_prob_from_update" in actor:
        check_choice(cfg, "actor_rollout_ref.actor.old_log_prob_from_update", (True, False))
    from_update = actor.get("old_log_prob_from_update")
    if from_update and (cfg.trainer.backend != "local" or actor.ppo_epochs != 1 or algo.use_kl_in_reward):
        raise ValueError("actor_rollout_ref.actor.old_log_prob_from_update=True takes the old log-probs from the "
                         "update's forward: it needs trainer.backend=local, actor.ppo_epochs=1 and no "
                         f"algorithm.use_kl_in_reward (got {cfg.trainer.backend}, {actor.ppo_epochs}, "
                         f"{algo.use_kl_in_reward})")
    filter_type = cfg.actor_rollout_ref.rollout.rollout_filter_type
    if filter_type not in ROLLOUT_FILTERS:
        raise ValueError(f"unknown rollout_filter_type {filter_type!r}; choose one of {sorted(ROLLOUT_FILTERS)}")
    if algo.adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={algo.adv_estimator!r} is not supported; choose one of "
                         f"{list(ADV_ESTIMATORS)}")
    if algo.bi_level_gae and (algo.adv_estimator != "gae" or cfg.agent_proxy.use_turn_scores):
        raise ValueError("algorithm.bi_level_gae=True needs algorithm.adv_estimator=gae and "
                         "agent_proxy.use_turn_scores=False")
    if not ADV_ESTIMATORS[algo.adv_estimator] and cfg.trainer.backend != "local":
        raise ValueError(f"algorithm.adv_estimator={algo.adv_estimator} runs on trainer.backend=local only (the verl "
                         "backend always builds a critic); use algorithm.adv_estimator=gae with trainer.backend=verl")
    if algo.get("drop_zero_variance_groups") and cfg.trainer.backend != "local":
        raise ValueError("algorithm.drop_zero_variance_groups=True runs on trainer.backend=local only (the verl "
                         "workers expect a fixed batch size); set it to False with trainer.backend=verl")
    if (actor.use_kl_loss or algo.use_kl_in_reward) and not actor.use_ref:
        raise ValueError("a KL loss or KL-in-reward needs the reference model: set actor_rollout_ref.actor.use_ref=True")
    if actor.use_kl_loss and algo.use_kl_in_reward:
        raise ValueError("choose one KL: actor_rollout_ref.actor.use_kl_loss or algorithm.use_kl_in_reward")
    for name, mode in (("actor_rollout_ref.actor", actor.loss_agg_mode), ("critic", cfg.critic.loss_agg_mode)):
        if mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown {name}.loss_agg_mode {mode!r}; choose one of {list(LOSS_AGG_MODES)}")
    scale = actor.get("loss_scale_factor")
    if scale is not None and not (isinstance(scale, int) and scale > 0):
        raise ValueError(f"actor_rollout_ref.actor.loss_scale_factor must be a positive integer or null, got {scale}")
    loss_mode = actor.policy_loss.loss_mode
    if loss_mode not in core_algos.POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown actor_rollout_ref.actor.policy_loss.loss_mode {loss_mode!r}; choose one of "
                         f"{sorted(core_algos.POLICY_LOSS_REGISTRY)}")
    if actor.clip_ratio_c <= 1:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1 (dual clip), got {actor.clip_ratio_c}")


def _check_trainer(cfg: DictConfig) -> None:
    trainer = cfg.trainer
    if not isinstance(trainer.total_training_steps, int) or trainer.total_training_steps < 1:
        raise ValueError(f"trainer.total_training_steps must be a positive integer, got {trainer.total_training_steps}")
    if trainer.resume_mode not in RESUME_MODES:
        raise ValueError(f"unknown trainer.resume_mode {trainer.resume_mode!r}; choose one of {list(RESUME_MODES)}")
    if trainer.test_freq > 0 and trainer.validation_steps < 1:
        raise ValueError("trainer.validation_steps must be >= 1 when trainer.test_freq > 0")
    test_steps = check_list(cfg, "trainer.test_steps", int, "[225,275]")
    if any(step < 1 for step in test_steps):
        raise ValueError(f"trainer.test_steps lists training steps (1 and up) to validate at, got {test_steps}")
    merged = trainer.get("save_merged_lora", True)
    if not isinstance(merged, bool):
        raise ValueError(f"trainer.save_merged_lora must be True or False, got {merged!r}")
    fraction = trainer.get("cuda_memory_fraction")
    if fraction is not None and (fraction == 0 or trainer.backend != "local"):
        raise ValueError("trainer.cuda_memory_fraction is the local backend's share of its GPU's memory, above 0 and "
                         f"at most 1, or null for no limit; got {fraction!r} with trainer.backend={trainer.backend}")
    if not merged and trainer.backend != "local":
        raise ValueError("trainer.save_merged_lora=False is a setting of the local backend; the verl backend always "
                         "saves the merged weights (hf_model)")
    diagnostics = trainer.diagnostics
    if diagnostics.mi_freq < 0 or (diagnostics.mi_freq > 0 and diagnostics.mi_samples < 2):
        raise ValueError("trainer.diagnostics needs mi_freq >= 0 (0 = off) and mi_samples >= 2 (prompts to tell apart), "
                         f"got mi_freq={diagnostics.mi_freq}, mi_samples={diagnostics.mi_samples}")

"""Stage 3 entry point: PPO of a multi-turn agent (spec §10).

    python -m SPA_agent.trainer.main_ppo --config-name _2_sokoban model_path=<sft checkpoint> \\
        trainer.experiment_name=my-run
    python -m SPA_agent.trainer.main_ppo --config-name _3_frozen_lake model=tiny      # CPU smoke run

Outputs go to `trainer.default_local_dir`: `config.yaml` (the composed config), `metrics.jsonl` (one line per
step), `global_step_<s>/{actor,critic}` checkpoints and `latest_checkpointed_iteration.txt`; with
`trainer.log_val_generations` also `val_generations.jsonl` (validation trajectories as text). A rerun with the
same directory resumes from the latest checkpoint (`trainer.resume_mode=auto`) when its `run_identity.json`
matches (same settings and starting model), and is refused otherwise; `trainer.resume_mode=disable` starts fresh.
With `trainer.max_wall_s` the run stops with a checkpoint once that much training time has passed and exits with
status 75 (EXIT_TO_BE_CONTINUED); the same command continues it. With `trainer.stop_after_uniform_scores` it
validates, saves and exits with status 4 (EXIT_REWARD_SIGNAL_LOST) after that many steps in a row in which every
trajectory scored the same.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from SPA_agent.config import CONFIG_DIR
from SPA_agent.entry import (
    apply_system_env,
    exit_on_interrupt,
    exit_on_user_error,
    hydra_entry,
    load_tokenizer,
    model_load_errors,
)
from SPA_agent.runs import run_identity
from SPA_agent.runs.atomic_io import write_text
from SPA_agent.runs.checkpoints import LATEST_FILE
from SPA_agent.runs.compile_cache import use_persistent_compile_cache
from SPA_agent.runs.dir_lock import DirLock, check_unlocked, check_writable
from SPA_agent.runs.progress import quiet_library_progress
from SPA_agent.runs.trainer_dir import TrainerDir
from SPA_agent.trainer.gc_heap import start_up_objects_frozen

#: a PPO run's directory: besides every trainer's outputs it writes the latest-step file and its config; config keys
#: beyond every trainer's that do not change its content (the starting models enter its identity by checksum)
RUN_DIR = TrainerDir.declare(
    owned=(LATEST_FILE, "config.yaml"),
    ignored=("trainer.resume_mode", "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep", "model_path",
             "actor_rollout_ref.model.path", "critic.model.path", "system", "output_root", "data_gen", "evaluation",
             "trainer.diagnostics", "trainer.max_wall_s", "trainer.save_merged_lora",
             "trainer.stop_after_uniform_scores", "trainer.log_val_generations"),
    fresh_hint="pass trainer.resume_mode=disable")
#: metrics of a step shown on its console line (trainer.logger contains console)
CONSOLE_KEYS = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "timing_s/step")
#: exit status of a run stopped by trainer.max_wall_s (sysexits' EX_TEMPFAIL: not failed, to be run again)
EXIT_TO_BE_CONTINUED = 75
#: exit status of a run stopped by trainer.stop_after_uniform_scores (not to be run again as it is)
EXIT_REWARD_SIGNAL_LOST = 4
OOM_ADVICE = (
    "out of GPU memory. Lower ppo_max_token_len_per_gpu and log_prob_max_token_len_per_gpu (token budgets of the "
    "update and log-prob/value micro-batches; micro_batch_size_per_gpu with use_dynamic_bsz=False), "
    "actor_rollout_ref.rollout.response_length (tokens per turn) or agent_proxy.max_turn; set "
    "actor_rollout_ref.model.enable_gradient_checkpointing=True and critic.model.enable_gradient_checkpointing=True; "
    "keep the reference model on the CPU with actor_rollout_ref.ref.offload_to_cpu=True; or lower "
    "generator.max_batch_tokens (cache tokens per decode batch) / actor_rollout_ref.rollout.gpu_memory_utilization."
)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_identity_of(cfg: DictConfig) -> run_identity.RunIdentity:
    """What determines a PPO run's content: the config minus RUN_DIR.ignored, and the starting models. The
    number of steps counts only where a warmup ratio makes the LR schedule depend on it; otherwise a finished
    run may be continued to more steps."""
    ignored = RUN_DIR.ignored if _schedule_uses_total_steps(cfg) else (*RUN_DIR.ignored, "trainer.total_training_steps")
    inputs = {"model": run_identity.model_checksum(cfg.actor_rollout_ref.model.path)}
    if cfg.critic.model.path != cfg.actor_rollout_ref.model.path:
        inputs["critic model"] = run_identity.model_checksum(cfg.critic.model.path)
    return run_identity.build_identity(OmegaConf.to_container(cfg, resolve=True), inputs, ignore=ignored)


def _schedule_uses_total_steps(cfg: DictConfig) -> bool:
    for optim in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
        if (optim.get("lr_warmup_steps") or -1) < 0 and optim.get("lr_warmup_steps_ratio", 0.0) > 0:
            return True
    return False


def load_backend(cfg: DictConfig, tokenizer):
    """The worker group; a model directory that cannot be loaded (corrupt weights or config) is a user error."""
    from SPA_agent.trainer.backend import build_backend

    with model_load_errors(cfg.actor_rollout_ref.model.path):
        return build_backend(cfg, tokenizer)


def build_trainer(cfg: DictConfig, lock: DirLock):
    """Check config, model and output directory, then build tokenizer, backend, agent proxy, logger and trainer
    (resumed when the directory holds a run of the same identity). Nothing is written before the checks."""
    from SPA_agent.rollout.agent_proxy import LLMAgentProxy
    from SPA_agent.runs.metrics_logger import MetricsLogger
    from SPA_agent.trainer.config_checks import check_config, check_sft_aux_files
    from SPA_agent.trainer.diagnostics import Diagnostics
    from SPA_agent.trainer.ppo_trainer import PPOTrainer

    check_config(cfg)
    check_sft_aux_files(cfg)
    output_dir = Path(cfg.trainer.default_local_dir)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.path)
    identity = run_identity_of(cfg)
    check_writable(output_dir)
    check_unlocked(output_dir)
    resume = RUN_DIR.resumable(output_dir, identity, cfg.trainer.resume_mode == "auto")
    seed_everything(cfg.trainer.seed)
    print(f"loading the models from {cfg.actor_rollout_ref.model.path} ({cfg.trainer.backend} backend)", flush=True)
    start = time.perf_counter()
    backend = load_backend(cfg, tokenizer)
    print(f"models loaded ({time.perf_counter() - start:.0f} s)", flush=True)
    proxy = LLMAgentProxy(cfg, backend, tokenizer, progress=True)
    lock.acquire()
    if not resume:
        RUN_DIR.reset(output_dir, identity)
    write_text(output_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    diagnostics = Diagnostics.for_proxy(cfg, backend, proxy)
    logger = MetricsLogger(output_dir, cfg.trainer.logger, cfg.trainer.project_name, cfg.trainer.experiment_name,
                           OmegaConf.to_container(cfg, resolve=True), CONSOLE_KEYS)
    trainer = PPOTrainer(cfg, backend, proxy, logger, diagnostics)
    if resume:
        trainer.resume()
    return trainer


def run(cfg: DictConfig) -> Path:
    """Train; returns the output directory. The directory is locked for the run (one writer at a time)."""
    lock = DirLock(Path(cfg.trainer.default_local_dir))
    try:
        trainer = build_trainer(cfg, lock)
        try:
            with start_up_objects_frozen(cfg.trainer.gc_freeze):
                trainer.fit()
        finally:
            trainer.logger.close()
    finally:
        lock.release()
    return trainer.output_dir


def _copy_environment(cfg: DictConfig) -> None:
    """Entry-point-only environment handling: visible GPUs from config; wandb offline without a key; the
    persistent compile cache (for compiled kernels; a Ray cluster started by this run inherits it)."""
    apply_system_env(cfg)
    use_persistent_compile_cache()
    if "wandb" in cfg.trainer.logger and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")


@hydra_entry(CONFIG_DIR, config_name="_2_sokoban")
def main(cfg: DictConfig) -> None:
    from SPA_agent.trainer.ppo_trainer import RewardSignalLost, WallTimeReached

    quiet_library_progress()
    _copy_environment(cfg)
    resume_hint = (f"the checkpoints saved so far are in {cfg.trainer.default_local_dir}; the same command with "
                   "trainer.resume_mode=auto (RESUME=1 in the scripts) continues from the latest")
    try:
        with exit_on_user_error(), exit_on_interrupt(resume_hint):
            output_dir = run(cfg)
    except torch.OutOfMemoryError:
        print(f"error: {OOM_ADVICE}", file=sys.stderr)
        sys.exit(3)
    except WallTimeReached as stop:
        print(f"{stop}; {resume_hint}", file=sys.stderr)
        sys.exit(EXIT_TO_BE_CONTINUED)
    except RewardSignalLost as stop:
        print(f"{stop}", file=sys.stderr)
        sys.exit(EXIT_REWARD_SIGNAL_LOST)
    print(f"PPO finished: {output_dir}")


if __name__ == "__main__":
    main()

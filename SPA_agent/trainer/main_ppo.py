"""Stage 3 entry point: PPO of a multi-turn agent (spec §10).

    python -m SPA_agent.trainer.main_ppo --config-name _2_sokoban model_path=<sft checkpoint> \\
        trainer.experiment_name=my-run
    python -m SPA_agent.trainer.main_ppo --config-name _3_frozen_lake model=tiny      # CPU smoke run

Outputs go to `trainer.default_local_dir`: `config.yaml` (the composed config), `metrics.jsonl` (one line per
step), `global_step_<s>/{actor,critic}` checkpoints and `latest_checkpointed_iteration.txt`. A rerun with the
same directory resumes from the latest checkpoint (`trainer.resume_mode=auto`).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from SPA_agent.config import CONFIG_DIR
from SPA_agent.entry import apply_system_env, exit_on_user_error

OOM_ADVICE = (
    "out of GPU memory. Lower micro_batch_size_per_gpu (log-prob, value and update micro-batches), "
    "actor_rollout_ref.rollout.response_length (tokens per turn) or agent_proxy.max_turn; set "
    "actor_rollout_ref.model.enable_gradient_checkpointing=True and critic.model.enable_gradient_checkpointing=True; "
    "keep the reference model on the CPU with actor_rollout_ref.ref.offload_to_cpu=True; or lower "
    "generator.batch_size / actor_rollout_ref.rollout.gpu_memory_utilization."
)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_trainer(cfg: DictConfig):
    """Check the config, then build tokenizer, backend, agent proxy, logger and trainer (resumed if asked)."""
    from transformers import AutoTokenizer

    from SPA_agent.agent_proxy import LLMAgentProxy
    from SPA_agent.atomic_io import write_text
    from SPA_agent.tiny import resolve_model_path
    from SPA_agent.trainer.backend import build_backend
    from SPA_agent.trainer.config_checks import check_config
    from SPA_agent.trainer.ppo_trainer import PPOTrainer
    from SPA_agent.trainer.tracking import MetricLogger

    check_config(cfg)
    output_dir = Path(cfg.trainer.default_local_dir)
    write_text(output_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    seed_everything(cfg.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.actor_rollout_ref.model.path))
    backend = build_backend(cfg, tokenizer)
    proxy = LLMAgentProxy(cfg, backend, tokenizer, mode=cfg.ctx_manager.mode)
    trainer = PPOTrainer(cfg, backend, proxy, MetricLogger(cfg, output_dir))
    trainer.resume()
    return trainer


def run(cfg: DictConfig) -> Path:
    """Train; returns the output directory."""
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.logger.close()
    return trainer.output_dir


def _copy_environment(cfg: DictConfig) -> None:
    """Entry-point-only environment handling: visible GPUs from config; wandb offline without a key."""
    apply_system_env(cfg)
    if "wandb" in cfg.trainer.logger and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")


@hydra.main(config_path=str(CONFIG_DIR), config_name="_2_sokoban", version_base="1.3")
def main(cfg: DictConfig) -> None:
    _copy_environment(cfg)
    try:
        with exit_on_user_error():
            output_dir = run(cfg)
    except torch.OutOfMemoryError:
        print(f"error: {OOM_ADVICE}", file=sys.stderr)
        sys.exit(3)
    print(f"PPO finished: {output_dir}")


if __name__ == "__main__":
    main()

"""The embedded `small` model (SPA_agent/tiny.py, config/model/small.yaml): built offline, ~25M parameters over the
tiny model's tokenizer, and the whole pipeline through `run_spa.sh` with MODEL=small at CPU sizes."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from SPA_agent.config import compose
from SPA_agent.model_presets import resolve_model_path
from SPA_agent.tiny import SMALL_SHAPE

REPO = Path(__file__).resolve().parents[1]
#: CPU sizes on the bandit (config/_bandit.yaml: one turn, ~190-token prompts): 2 × 2 envs, one PPO step, 32 new
#: tokens per answer (the from-scratch model rarely ends one, and its preset allows 256)
CPU_SIZES = [
    "es_manager.train.env_groups=2", "es_manager.train.group_size=2", "es_manager.train.env_configs.n_groups=[2]",
    "es_manager.val.env_groups=1", "es_manager.val.group_size=2", "es_manager.val.env_configs.n_groups=[1]",
    "ppo_mini_batch_size=2", "micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.rollout_filter_ratio=1",
    "trainer.test_freq=0", "actor_rollout_ref.rollout.response_length=32", "evaluation.n=2", "evaluation.k=[1,2]", "evaluation.bootstrap_resamples=20",
    "evaluation.write_plots=false",
]


@pytest.fixture(scope="module")
def small_dir():
    return Path(resolve_model_path("small"))


def test_small_is_a_25m_qwen2_over_the_tiny_tokenizer(small_dir, tiny_dir):
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(small_dir)
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers) == (SMALL_SHAPE["hidden_size"], 8) == (512, 8)
    with safe_open(small_dir / "model.safetensors", "pt") as weights:
        n_params = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    assert 20e6 < n_params < 30e6
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (small_dir / name).read_bytes() == (Path(tiny_dir) / name).read_bytes()


def test_model_small_preset_selects_the_embedded_model():
    cfg = compose("_2_sokoban", ["model=small"])
    assert cfg.model_path == cfg.actor_rollout_ref.model.path == cfg.critic.model.path == "small"
    assert cfg.model_size == "small"


@pytest.mark.extended  # about 50 s, left out of CI's default run (the suite must stay under 15 minutes)
def test_run_spa_with_model_small_runs_every_stage_on_cpu(tmp_path):
    dirs = {"OUTPUT_DIR": tmp_path / "data", "CHECKPOINT_DIR": tmp_path / "sft", "BASE_DIR": tmp_path / "ppo",
            "EVAL_DIR": tmp_path / "evals"}
    env = {**os.environ, **{k: str(v) for k, v in dirs.items()}, "MODEL": "small", "BT_NUM": "1", "TOTAL_STEPS": "1",
           "SFT_OVERRIDES": "trainer.total_training_steps=1 data.train_batch_size=2 trainer.device=cpu"}
    result = subprocess.run(["bash", str(REPO / "run_spa.sh"), "_bandit", "last", "True", *CPU_SIZES],
                            capture_output=True, text=True, check=False, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((dirs["OUTPUT_DIR"] / "data_card.json").read_text())["num_train"] > 0
    sft_step = sorted(dirs["CHECKPOINT_DIR"].glob("global_step_*"))[-1]
    assert json.loads((sft_step / "config.json").read_text())["hidden_size"] == 512
    run_dir = next((dirs["BASE_DIR"] / "_bandit").iterdir())
    assert "-small-" in run_dir.name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 1 and "actor/pg_loss" in records[-1]
    for which in ("before_ppo", "after_ppo"):
        assert json.loads((dirs["EVAL_DIR"] / which / "eval.json").read_text())["complete"] is True

"""The verl fix applied in every Ray worker: the critic's value model loads without flash-attn (issue 16)."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoConfig

from SPA_agent.config import compose
from SPA_agent.trainer import verl_backend, verl_config, verl_patches


def test_value_model_loads_with_the_configs_attention(tiny_dir):
    import verl.utils.model as verl_model

    original = verl_model.load_valuehead_model
    try:
        verl_patches.apply()
        config = AutoConfig.from_pretrained(tiny_dir, attn_implementation="sdpa")
        config.num_labels = 1  # as verl's FSDP engine sets it for a value model
        model = verl_model.load_valuehead_model(str(tiny_dir), torch.float32, config, False)
    finally:
        verl_model.load_valuehead_model = original
    assert type(model).__name__ == "Qwen2ForTokenClassification"
    assert model.config._attn_implementation == "sdpa" and model.score.out_features == 1


@pytest.mark.parametrize("all_gpus_visible", [True, False])
def test_every_ray_worker_runs_the_patch_and_sees_the_gpus_as_configured(all_gpus_visible):
    cfg = compose("_2_sokoban", ["model=tiny", "trainer.backend=verl", f"verl_backend.all_gpus_visible={all_gpus_visible}"])
    env = verl_backend.ray_runtime_env(verl_config.build_verl_config(cfg), cfg.verl_backend.all_gpus_visible)
    module, function = env["worker_process_setup_hook"].rsplit(".", 1)
    assert getattr(importlib.import_module(module), function) is verl_patches.apply
    assert "TOKENIZERS_PARALLELISM" in env["env_vars"]  # verl's own runtime environment is kept
    # one GPU visible per worker made NCCL stop with "Duplicate GPU detected" on 2× H200 (issue 16)
    assert (env["env_vars"].get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") == "1") is all_gpus_visible

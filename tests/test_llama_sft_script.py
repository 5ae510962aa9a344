"""`MODEL=llama1B` through sft/finetune_ft.sh: the script maps it to meta-llama/Llama-3.2-1B-Instruct and trains.

No model can be downloaded here, so a Llama-architecture model of a few thousand parameters with a Llama-3
chat template is placed in a private Hugging Face cache under that hub id and loaded offline: everything from
the script's argument to the saved checkpoint is the real code path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from SPA_agent.config import compose
from SPA_agent.selfplay.generate import generate, prepare_data_gen_config

REPO = Path(__file__).resolve().parents[1]
LLAMA_ID = "meta-llama/Llama-3.2-1B-Instruct"


def _cache_llama(hf_home: Path, tokenizer) -> None:
    """A tiny LlamaForCausalLM + tokenizer as the cached snapshot of LLAMA_ID."""
    from transformers import LlamaConfig, LlamaForCausalLM

    repo = hf_home / "hub" / f"models--{LLAMA_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)


def test_config_preset_and_sft_script_name_the_same_llama_model():
    assert compose("_2_sokoban", ["model=llama3.2-1b"]).model_path == LLAMA_ID
    # the script takes the model from the model-size table (SPA_agent/model_presets.py), which reads the preset
    result = subprocess.run(["bash", str(REPO / "sft" / "finetune_ft.sh"), "_2_sokoban", "1", "/nonexistent/sft",
                             "/nonexistent/data", "llama1B"], capture_output=True, text=True, check=True,
                            env={**os.environ, "SPA_PRINT_STAGE": "1"}, timeout=120)
    assert f"model.partial_pretrain={LLAMA_ID}" in result.stdout.splitlines()


@pytest.mark.slow
def test_finetune_script_trains_the_llama_preset(tmp_path, llama_tokenizer):
    _cache_llama(tmp_path / "hf", llama_tokenizer)
    data = tmp_path / "data"
    cfg = compose("_2_sokoban", ["model=tiny", "generator=random", "data_gen.num_batches=1",
                                 f"data_gen.output_dir={data}", "es_manager.train.env_groups=2",
                                 "es_manager.train.env_configs.n_groups=[2]", "agent_proxy.max_turn=2"])
    generate(prepare_data_gen_config(cfg, "_2_sokoban"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(REPO / "sft" / "finetune_ft.sh"), "_2_sokoban", "1", str(tmp_path / "sft"), str(data), "llama1B",
         "trainer.total_epochs=1", "data.train_batch_size=4", "data.max_tokens_per_micro_batch=4096",
         "data.max_length=4096",
         "trainer.device=cpu"],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    (step,) = sorted((tmp_path / "sft").glob("global_step_*"))
    assert json.loads((step / "config.json").read_text())["model_type"] == "llama"
    saved = OmegaConf.load(tmp_path / "sft" / "sft_config.yaml")
    assert saved.model.partial_pretrain == LLAMA_ID
    assert saved.trainer.experiment_name == "_2_sokoban-sft-llama-3.2-llama1B-instruct"



"""Wrapping a model with PEFT LoRA adapters, configured by the same keys in both trainers: `model.*` of the SFT
config and `<role>.model.*` of the PPO config (verl's names: `lora_rank`, `lora_alpha`, `target_modules`,
`exclude_modules`). What the PPO trainer does with adapted models is in
SPA_agent/trainer/local_backend/lora.py."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig
from torch import nn

#: name of the value head of AutoModelForTokenClassification (trained in full, never adapted)
VALUE_HEAD = "score"


def lora_rank(model_cfg: DictConfig) -> int:
    """The model's LoRA rank (`lora_rank`, 0 or absent = full fine-tuning)."""
    return int(model_cfg.get("lora_rank", 0) or 0)


def _names(value) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    return list(value) if isinstance(value, (list, tuple, ListConfig)) else value


def add_lora(model: nn.Module, model_cfg: DictConfig, config_key: str, value_model: bool = False) -> nn.Module:
    """Wrap `model` with LoRA adapters (`lora_rank`, `lora_alpha`, `target_modules`, `exclude_modules`, no bias)
    when `lora_rank > 0`; otherwise return it unchanged. `config_key` (e.g. `critic.model`) names the config
    group in errors.

    A value model (`value_model=True`, a token-classification model) keeps its value head out of the adapted
    modules and trains it in full (PEFT's modules_to_save for TOKEN_CLS).
    """
    rank = lora_rank(model_cfg)
    if rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    exclude = _names(model_cfg.get("exclude_modules"))
    if value_model:
        exclude = [VALUE_HEAD, *([exclude] if isinstance(exclude, str) else exclude or [])]
    config = LoraConfig(r=rank, lora_alpha=model_cfg.lora_alpha, target_modules=_names(model_cfg.target_modules),
                        exclude_modules=exclude, bias="none", task_type="TOKEN_CLS" if value_model else "CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as err:  # e.g. a module name the model does not have: name our keys
        raise ValueError(f"{config_key}.target_modules / exclude_modules: {err}") from err

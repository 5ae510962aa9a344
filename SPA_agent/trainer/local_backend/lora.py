"""LoRA adapters for the `local` backend's actor and critic (PEFT), configured with verl's keys.

`<role>.model.lora_rank > 0` wraps the model in a PEFT LoRA model (`SPA_agent.runs.lora.add_lora`): the base
weights are frozen and only the adapters (and, for the critic, the value head `score`) train. The reference policy is then the actor with its
adapters disabled, so no second copy of the weights is held. Generation and evaluation see merged weights
W + (lora_alpha / lora_rank) · B A, computed without touching W (`merged_state_dict`).

Checkpoint of a LoRA role (`global_step_N/<role>/`): the merged Hugging Face model (what evaluation loads),
`adapter/` (PEFT's `save_pretrained`: the adapters and the critic's value head) and the optimizer state; with
trainer.save_merged_lora=False only the last two, a few MB (docs/relay.md). Resuming rebuilds the base model from
`<role>.model.path` and loads `adapter/` into it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

#: sub-directory of a role's checkpoint holding the PEFT adapter
ADAPTER_DIR = "adapter"
_ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".original_module.")


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is a PEFT model (built by `SPA_agent.runs.lora.add_lora`)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer updates: all of a plain model, the adapters (and value head) of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


def adapted_model(model: nn.Module) -> nn.Module:
    """The transformers model to run: a LoRA model's base with its adapter layers injected (adapters active),
    or a plain model itself."""
    return model.get_base_model() if is_lora(model) else model


def generation_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) pairs for a generation copy: merged under LoRA, else the parameters."""
    return merged_weights(model) if is_lora(model) else model.named_parameters()


@torch.no_grad()
def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapted model's state, one tensor at a time with plain Hugging Face names: an adapted weight is
    W + ΔW (ΔW = PEFT's `get_delta_weight`), the value head is its trained copy. W is not modified, and a merged
    weight exists only until the consumer drops it (a 3B model's merged copy would be 12 GB in float32)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapter = model.active_adapter
    adapted = {f"{name}.base_layer.weight": module for name, module in base.named_modules()
               if isinstance(module, LoraLayer)}
    for key, value in base.state_dict().items():
        if any(marker in key for marker in _ADAPTER_MARKERS):
            continue
        name = key.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
        yield name, (value + adapted[key].get_delta_weight(adapter).to(value.dtype) if key in adapted else value)


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole merged state dict of a LoRA model (`merged_weights`) on the CPU, e.g. to save it."""
    return {name: value.cpu() for name, value in merged_weights(model)}


def save_merged(model: nn.Module, directory: Path) -> None:
    """A Hugging Face directory loadable by `from_pretrained` (merged weights); with LoRA, also `adapter/`."""
    if not is_lora(model):
        model.save_pretrained(directory)
        return
    model.get_base_model().save_pretrained(directory, state_dict=merged_state_dict(model))
    save_adapter(model, directory)


def save_adapter(model: nn.Module, directory: Path) -> None:
    """Only `directory/adapter` (the adapters and a value model's head): what `load_adapter` restores, without the
    merged weights (trainer.save_merged_lora=False)."""
    model.save_pretrained(Path(directory) / ADAPTER_DIR)


def load_adapter(model: nn.Module, directory: Path) -> None:
    """Load `directory/adapter` (written by `save_merged`) into a LoRA model built with the same settings."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    source = Path(directory) / ADAPTER_DIR
    if not source.is_dir():
        raise FileNotFoundError(f"{directory} has no {ADAPTER_DIR}/: it was not saved by a LoRA run "
                                "(set the same model.lora_rank as the run that wrote it)")
    result = set_peft_model_state_dict(model, load_peft_weights(str(source), device="cpu"))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"{source} does not match this model's adapters: unexpected {unexpected[:3]}")

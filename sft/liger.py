"""Liger-kernel for SFT (`model.use_liger=true`, optional extra `pip install -e '.[liger]'`, CUDA GPUs only).

`apply_liger` swaps Liger's Triton kernels into a Qwen2 or Llama model before FSDP wraps it: RMSNorm, the SwiGLU
MLP, rotary embeddings and the fused linear cross-entropy, which projects hidden states onto the vocabulary chunk
by chunk and computes the loss and its gradients without keeping the (positions × vocabulary) logits.

`fused_token_loss_sum` is `packing.token_loss_sum` through that fused loss: the same positions (those some row
labels), the same shifted labels (IGNORE_INDEX where the loss mask is 0) and the same reduction (a sum over
labelled tokens), so the trainer's normalisation (÷ trained tokens of the global batch) is unchanged.
"""

from __future__ import annotations

import importlib.util

import torch

from sft.packing import labelled_positions

#: model_type → Liger's patch function for it (the models whose fused-loss forward we use and test)
PATCHES = {"qwen2": "apply_liger_kernel_to_qwen2", "llama": "apply_liger_kernel_to_llama"}
INSTALL_HINT = "pip install -e '.[liger]'"
#: Liger splits the positions into chunks of about chunk_mem_const × hidden / vocab rows (next power of two) and
#: reads the whole output projection once per chunk. Its default (1) suits a loss over every position; we pass only
#: the trained ones (~2,100 of a 16,384-token packed micro-batch of SPA-shaped rows), where it would make chunks of
#: 32 rows for Qwen2.5-1.5B and re-read the 151,936 × 1,536 projection ~65 times per micro-batch. 32 makes chunks
#: of 1,024 rows (0.3 GB of bf16 logits each at that vocabulary).
CHUNK_MEM_CONST = 32


def resolve_liger(setting, model_type: str, use_cuda: bool, deterministic: bool) -> bool:
    """Whether the SFT uses Liger's kernels under model.use_liger = true | false | auto. `auto`: where they can run
    (a CUDA GPU, a supported model, the package installed), and not with trainer.deterministic, whose run-to-run
    equality is tested for PyTorch's kernels only. `true` raises `check_liger`'s one-line error where they cannot."""
    if setting is True:
        check_liger(model_type, use_cuda)
        return True
    return (setting == "auto" and not deterministic and use_cuda and model_type in PATCHES
            and importlib.util.find_spec("liger_kernel") is not None)


def check_liger(model_type: str, use_cuda: bool) -> None:
    """One-line ValueError when `model.use_liger=true` cannot run: unsupported model, no GPU, or no package."""
    if model_type not in PATCHES:
        raise ValueError(f"model.use_liger=true supports {' and '.join(PATCHES)} models, not {model_type!r}; "
                         "set model.use_liger=false")
    if not use_cuda:
        raise ValueError("model.use_liger=true runs on CUDA GPUs only (Triton kernels); set model.use_liger=false")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError(f"model.use_liger=true needs the liger-kernel package ({INSTALL_HINT})")


def apply_liger(model: torch.nn.Module) -> None:
    """Patch `model` in place (call before LoRA and FSDP wrapping).

    Liger replaces RoPE through the model's transformers module, so every model of that type built in this process
    uses Liger's RoPE afterwards; RMSNorm, MLP and the forward are patched on this instance only.
    """
    import liger_kernel.transformers as liger

    patch = getattr(liger, PATCHES[model.config.model_type])
    patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True, model=model)


def fused_token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                         chunk_mem_const: int = CHUNK_MEM_CONST) -> torch.Tensor:
    """Summed cross-entropy (a scalar) over the labelled positions of one micro-batch, via Liger's fused loss.

    batch: input_ids, position_ids, labels (B, T) and optionally attention_mask (B, T), as for `token_loss_sum`.
    Our labels are already shifted (position i scores token i+1), so they go in as `shift_labels`, restricted to
    the kept positions like the hidden states (`logits_to_keep`). Liger reduces with "sum" when given
    `num_items_in_batch` and divides by it: 1 keeps the sum.
    """
    labels = batch["labels"]
    keep = labelled_positions(labels)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    output = model(**inputs, use_cache=False, logits_to_keep=keep, shift_labels=labels[:, keep].contiguous(),
                   skip_logits=True, num_items_in_batch=1, chunk_mem_const=chunk_mem_const)
    return output.loss

"""Liger-kernel's fused RMSNorm, SwiGLU and rotary embedding in a generation model (`generator.liger_kernels`).

A narrow model's decode step is mostly small kernels: transformers' RMSNorm is about six elementwise kernels, its
MLP activation two, its rotary embedding a dozen, per layer (SmolLM2: 30 layers, ~1,000 kernels a step). Liger's
Triton kernels do each in one: on the 0.5B shape they cut a decode step from 4.74 to 3.21 ms (benchmarks/RESULTS.md).
Same arithmetic (float32 statistics, the result in the model's dtype as transformers rounds it), so the same
sampling distribution; the samples can differ where bf16 rounding differs.

Only the generation model is changed: `patch_model` rebinds the forward of this instance's RMSNorm and MLP
modules, and the rotary embedding, which transformers calls as a module-level function, is swapped in only while
`fused_rope` is open (the generator's calls), so the PPO actor trained in the same process keeps transformers' own
functions. CUDA GPUs only (Triton); `pip install -e '.[liger]'`. `auto` uses them where they can run.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator

#: model_type → the transformers module whose RMSNorm, MLP and apply_rotary_pos_emb the model uses
MODEL_MODULES = {"llama": "transformers.models.llama.modeling_llama",
                 "qwen2": "transformers.models.qwen2.modeling_qwen2"}
INSTALL_HINT = "pip install -e '.[liger]'"


def resolve(setting, model) -> bool:
    """Whether to use Liger's kernels for `model` under generator.liger_kernels = true | false | auto. Only on a CUDA
    GPU (CPU decoding keeps transformers' float32 modules); `auto` where they can run (a supported model, the
    package installed), `true` raises a one-line ValueError where they cannot."""
    if str(setting).lower() not in ("true", "false", "auto"):
        raise ValueError(f"generator.liger_kernels must be true, false or auto, got {setting!r}")
    if str(setting).lower() == "false" or next(model.parameters()).device.type != "cuda":
        return False
    if str(setting).lower() == "auto":
        return model.config.model_type in MODEL_MODULES and importlib.util.find_spec("liger_kernel") is not None
    check_liger(model)
    return True


def check_liger(model) -> None:
    """One-line ValueError when generator.liger_kernels=true cannot run on this model's device."""
    model_type = model.config.model_type
    if model_type not in MODEL_MODULES:
        raise ValueError(f"generator.liger_kernels=true supports {' and '.join(MODEL_MODULES)} models, not "
                         f"{model_type!r}; set generator.liger_kernels=false")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError(f"generator.liger_kernels=true needs the liger-kernel package ({INSTALL_HINT}) or "
                         "generator.liger_kernels=false")


def patch_model(model) -> None:
    """Liger's RMSNorm and SwiGLU forward on this model instance's norms and MLPs (weights untouched)."""
    from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module, _patch_swiglu_module
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    decoder = model.get_decoder()
    _patch_rms_norm_module(decoder.norm)
    for layer in decoder.layers:
        _patch_rms_norm_module(layer.input_layernorm)
        _patch_rms_norm_module(layer.post_attention_layernorm)
        _patch_swiglu_module(layer.mlp, LigerSwiGLUMLP)


@contextlib.contextmanager
def fused_rope(model) -> Iterator[None]:
    """Liger's rotary embedding in the model's transformers module for the duration, transformers' own after."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    module = importlib.import_module(MODEL_MODULES[model.config.model_type])
    original = module.apply_rotary_pos_emb
    module.apply_rotary_pos_emb = liger_rotary_pos_emb
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = original

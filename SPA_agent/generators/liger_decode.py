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

The local PPO backend's training models use the same kernels under their own switch
(`actor_rollout_ref.model.liger_training`) through `fused_kernels`: patched norms and MLPs and the fused rotary
function only while a training pass runs (its forward and its backward, which re-runs the forward under gradient
checkpointing), the model as it was outside, so the rollout copy made from the actor and the generator keep what
their own switch says. Liger's kernels are autograd Functions: the backward passes are theirs.
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


def resolve(setting, model, key: str = "generator.liger_kernels") -> bool:
    """Whether to use Liger's kernels for `model` under `key` (generator.liger_kernels or the PPO backend's
    actor_rollout_ref.model.liger_training) = true | false | auto. Only on a CUDA GPU (CPU models keep transformers'
    float32 modules); `auto` where they can run (a supported model, the package installed), `true` raises a
    one-line ValueError where they cannot."""
    if str(setting).lower() not in ("true", "false", "auto"):
        raise ValueError(f"{key} must be true, false or auto, got {setting!r}")
    if str(setting).lower() == "false" or next(model.parameters()).device.type != "cuda":
        return False
    if str(setting).lower() == "auto":
        return model.config.model_type in MODEL_MODULES and importlib.util.find_spec("liger_kernel") is not None
    check_liger(model, key)
    return True


def check_liger(model, key: str = "generator.liger_kernels") -> None:
    """One-line ValueError when `key`=true cannot run on this model's device."""
    model_type = model.config.model_type
    if model_type not in MODEL_MODULES:
        raise ValueError(f"{key}=true supports {' and '.join(MODEL_MODULES)} models, not {model_type!r}; set "
                         f"{key}=false")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError(f"{key}=true needs the liger-kernel package ({INSTALL_HINT}) or {key}=false")


def _norms_and_mlps(model) -> tuple[list, list]:
    """The RMSNorm and MLP modules of the model's decoder (also through a PEFT wrapper, whose LoRA layers sit
    inside the MLPs' projections and keep working under Liger's forward)."""
    decoder = model.get_decoder()
    norms = [decoder.norm, *(n for layer in decoder.layers for n in (layer.input_layernorm,
                                                                     layer.post_attention_layernorm))]
    return norms, [layer.mlp for layer in decoder.layers]


def patch_model(model) -> None:
    """Liger's RMSNorm and SwiGLU forward on this model instance's norms and MLPs (weights untouched)."""
    from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module, _patch_swiglu_module
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    norms, mlps = _norms_and_mlps(model)
    for norm in norms:
        _patch_rms_norm_module(norm)
    for mlp in mlps:
        _patch_swiglu_module(mlp, LigerSwiGLUMLP)


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


@contextlib.contextmanager
def fused_kernels(model) -> Iterator[None]:
    """All of Liger's kernels in this model for the duration (`patch_model` and `fused_rope`), and the model as it
    was after: the attributes Liger set on its norms and MLPs are removed, so their classes' forwards are back."""
    norms, mlps = _norms_and_mlps(model)
    modules = [*norms, *mlps]
    before = [set(vars(module)) for module in modules]
    patch_model(model)
    try:
        with fused_rope(model):
            yield
    finally:
        for module, keys in zip(modules, before):
            for key in set(vars(module)) - keys:
                delattr(module, key)

"""One GEMM for q, k and v, one for gate and up, in a generation model (`generator.fused_projections`, issue 42).

A narrow model's decode step is bound by its kernel launches, not its arithmetic: on an H200 a SmolLM2-135M decode
step (30 layers, hidden 576, 9 query / 3 key-value heads, MLP 1536) replayed as a CUDA graph takes ~2.3 ms at any
cache length, ~17–20 kernels of 3–4 µs a layer, five of them GEMMs: q_proj, k_proj, v_proj, gate_proj, up_proj.
Here each layer's q/k/v projections are one GEMM over a [Q+K+V, hidden] weight and its gate/up projections one GEMM
over a [2·I, hidden] weight, followed by one Triton kernel for SiLU(gate)·up read from the fused output (Liger's
SwiGLU kernel needs two contiguous halves). The query and key heads are rotated in place in the fused output by one
Triton kernel (`rotary_triton`; Liger's rotary would first copy the strided q and k slices to contiguous tensors, two
more kernels). Against Liger's kernels (generator.liger_kernels): three kernels fewer a layer, ~90 of a SmolLM2
step's ~550. Not yet timed on a GPU.

Weights: `fuse_projections` copies each group's weights (and biases: Qwen2's q/k/v) into one contiguous buffer and
makes `q_proj.weight`, `k_proj.weight`, `v_proj.weight` (`gate_proj.weight`, `up_proj.weight`) Parameters that are
row slices of it. So `named_parameters()` lists the same names, `copy_` by name (the PPO backend's `copy_weights`
into its rollout copy) writes into the buffer the fused GEMM reads, and the addresses the static decoder's kept CUDA
graphs were captured with do not change. Fuse a model on its final device and dtype: `.to()` or a deep copy gives
the Parameters storage of their own, which the fused GEMMs would no longer read.

What stays exact: a fused GEMM computes the same dot products as the three (two) it replaces, so the logits are
transformers' up to the GEMM's summation order (float32 on CPU: within 1e-5, tested). The SwiGLU kernel rounds as
transformers does in bf16 and as Liger's SwiGLU does: SiLU in float32, rounded to the model's dtype, times `up` in
that dtype. The rotary kernel computes in float32 and rounds once (transformers rounds each product and the sum in
bf16). So the sampling distribution is the same up to bf16 rounding. Only the generation model changes: this
instance's attention and MLP forwards are rebound (as liger_decode.patch_model does), and with autograd enabled they
run transformers' own forward over the same Parameters, so a model that trains keeps its gradients. CUDA GPUs only
in the generator (`resolve`); on CPU (tests call `fuse_projections` there) the fused GEMMs are followed by
transformers' rotary function and `swiglu_torch`; the Triton kernels are tested on CPU under Triton's interpreter.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from SPA_agent.generators.liger_decode import MODEL_MODULES

KEY = "generator.fused_projections"
#: the activations of the MLPs this fuses (transformers' ACT2FN names of SiLU)
SILU = ("silu", "swish")
#: columns of the fused gate/up output a program of the SwiGLU kernel reads (per row)
SWIGLU_BLOCK = 512


def resolve(setting, model) -> bool:
    """Whether to fuse `model`'s projections under generator.fused_projections = true | false | auto, as
    liger_decode.resolve: only on a CUDA GPU (CPU models keep transformers' float32 modules); `auto` where the model
    is supported, `true` raises a one-line ValueError where it is not."""
    if str(setting).lower() not in ("true", "false", "auto"):
        raise ValueError(f"{KEY} must be true, false or auto, got {setting!r}")
    if str(setting).lower() == "false" or next(model.parameters()).device.type != "cuda":
        return False
    problem = unsupported(model)
    if problem is not None and str(setting).lower() == "true":
        raise ValueError(f"{KEY}=true {problem}; set {KEY}=false")
    return problem is None


def unsupported(model) -> str | None:
    """Why `model`'s projections cannot be fused (None where they can): a llama or qwen2 model whose q/k/v and
    gate/up projections are plain nn.Linear layers (no LoRA wrappers) and whose MLPs use SiLU."""
    if model.config.model_type not in MODEL_MODULES:
        return f"supports {' and '.join(MODEL_MODULES)} models, not {model.config.model_type!r}"
    if model.config.hidden_act not in SILU:
        return f"fuses SiLU MLPs, not {model.config.hidden_act!r}"
    for layer in model.get_decoder().layers:
        projections = [*_qkv(layer.self_attn), *_gate_up(layer.mlp)]
        if not all(type(linear) is nn.Linear for linear in projections):
            return "needs plain nn.Linear projections (a LoRA model's rollout copy is plain)"
    return None


def _qkv(attention: nn.Module) -> list[nn.Linear]:
    return [attention.q_proj, attention.k_proj, attention.v_proj]


def _gate_up(mlp: nn.Module) -> list[nn.Linear]:
    return [mlp.gate_proj, mlp.up_proj]


def fuse_projections(model) -> None:
    """Fuse every layer's q/k/v and gate/up projections of this model instance (see the module docstring); on any
    device (the generator calls it on a CUDA GPU only, through `resolve`)."""
    problem = unsupported(model)
    if problem is not None:
        raise ValueError(f"fuse_projections {problem}")
    for layer in model.get_decoder().layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.fused_weight, attention.fused_bias = _fuse(_qkv(attention))
        attention.fused_sizes = [linear.out_features for linear in _qkv(attention)]
        attention.forward = types.MethodType(fused_attention_forward, attention)
        mlp.fused_weight, mlp.fused_bias = _fuse(_gate_up(mlp))
        mlp.forward = types.MethodType(fused_mlp_forward, mlp)


@torch.no_grad()
def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One contiguous (sum of out_features, in_features) buffer holding the layers' weights (and one for their
    biases where they have them); each layer's weight (bias) becomes a Parameter over its rows of the buffer."""
    weight = torch.cat([linear.weight for linear in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([linear.bias for linear in linears]) if has_bias else None
    rows = [linear.out_features for linear in linears]
    for index, linear in enumerate(linears):
        linear.weight = nn.Parameter(weight.split(rows)[index], requires_grad=linear.weight.requires_grad)
        if has_bias:
            linear.bias = nn.Parameter(bias.split(rows)[index], requires_grad=linear.bias.requires_grad)
    return weight, bias


def fused_attention_forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                            attention_mask: torch.Tensor | None, past_key_values=None, **kwargs):
    """LlamaAttention.forward / Qwen2Attention.forward with q, k and v from one GEMM (bound to an attention module
    by `fuse_projections`). hidden_states (B, T, hidden) → (B, T, hidden) and the attention weights, as theirs.
    With autograd enabled, the class's own forward (three GEMMs over the same Parameters)."""
    if torch.is_grad_enabled():
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    modeling = sys.modules[type(self).__module__]  # read at call time: liger_decode.fused_rope swaps its rotary
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    fused = F.linear(hidden_states, self.fused_weight, self.fused_bias)  # (B, T, Q + K + V)
    cos, sin = position_embeddings
    rotated = rotary_runs(fused, cos, self.head_dim)
    if rotated:  # q and k rotated in place, in the fused output
        rotary_triton(fused, cos, sin, (self.fused_sizes[0] + self.fused_sizes[1]) // self.head_dim)
    query, key, value = (part.view(hidden_shape).transpose(1, 2) for part in fused.split(self.fused_sizes, dim=-1))
    if not rotated:
        query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    attention = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                               modeling.eager_attention_forward)
    window = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}  # Qwen2's argument
    output, weights = attention(self, query, key, value, attention_mask,
                                dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                **window, **kwargs)
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """down(SiLU(gate(x)) · up(x)) with gate and up from one GEMM (bound to an MLP by `fuse_projections`);
    x (…, hidden) → (…, hidden). With autograd enabled, the class's own forward."""
    if torch.is_grad_enabled():
        return type(self).forward(self, x)
    return self.down_proj(swiglu(F.linear(x, self.fused_weight, self.fused_bias)))


def swiglu(fused: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up of a fused gate/up output (…, 2I), gate its first I columns → (…, I): the Triton kernel on a
    CUDA GPU, `swiglu_torch` elsewhere."""
    if fused.is_cuda and importlib.util.find_spec("triton") is not None:
        return swiglu_triton(fused)
    return swiglu_torch(fused)


def swiglu_torch(fused: torch.Tensor) -> torch.Tensor:
    """`swiglu` as transformers' LlamaMLP computes it: SiLU in the input's dtype (float32 inside, rounded), then the
    product in that dtype."""
    gate, up = fused.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_triton(fused: torch.Tensor, block: int = SWIGLU_BLOCK) -> torch.Tensor:
    """`swiglu` in one Triton kernel: one program per (row, `block` columns) of the output, SiLU in float32 rounded
    to the input's dtype, then the product in that dtype (Liger's SwiGLU rounding). Any number of columns; the rows
    of `fused` may be strided, its columns must be contiguous."""
    width = fused.shape[-1] // 2
    rows = fused.reshape(-1, 2 * width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    output = rows.new_empty(rows.shape[0], width)
    grid = (rows.shape[0], -(-width // block))
    _swiglu_kernel()[grid](rows, output, width, rows.stride(0), output.stride(0), BLOCK=block)
    return output.view(*fused.shape[:-1], width)


def rotary_runs(fused: torch.Tensor, cos: torch.Tensor, head_dim: int) -> bool:
    """Whether `rotary_triton` rotates this fused q/k/v output: a CUDA tensor, triton installed, the whole head
    rotated (cos (B or 1, T, head_dim)) and a head of a power of two of at least 4 entries."""
    return (fused.is_cuda and importlib.util.find_spec("triton") is not None and cos.shape[-1] == head_dim
            and head_dim >= 4 and head_dim & (head_dim - 1) == 0)


def rotary_triton(fused: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
    """transformers' apply_rotary_pos_emb on the first `heads` heads (the query heads, then the key heads) of each
    token's row of a fused q/k/v output (B, T, ·), in place, in one Triton kernel: one program per token, float32
    products rounded once to the output's dtype (transformers rounds each product and the sum in bf16, Liger's
    kernel computes in the cos dtype). cos, sin: (B or 1, T, D), contiguous in D. Here rather than Liger's rotary,
    which copies the strided q and k slices of the fused output to contiguous tensors first (two more kernels)."""
    batch, tokens, columns = fused.shape
    head_dim = cos.shape[-1]
    rows = fused.view(batch * tokens, columns)
    cos, sin = cos.expand(batch, tokens, head_dim), sin.expand(batch, tokens, head_dim)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    _rotary_kernel()[(batch * tokens,)](rows, cos, sin, rows.stride(0), cos.stride(0), cos.stride(1), tokens,
                                         HEADS=heads, HEADS_PAD=1 << (heads - 1).bit_length(), HALF=head_dim // 2)


@functools.cache
def _rotary_kernel():
    """The Triton rotary kernel, defined on first use so that importing this module needs no triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rotary(rows, cos, sin, stride_row, stride_angle_batch, stride_angle_token, tokens,
                HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        half = tl.arange(0, HALF)
        angle = (row // tokens) * stride_angle_batch + (row % tokens) * stride_angle_token + half
        cos_1, cos_2 = tl.load(cos + angle).to(tl.float32), tl.load(cos + angle + HALF).to(tl.float32)
        sin_1, sin_2 = tl.load(sin + angle).to(tl.float32), tl.load(sin + angle + HALF).to(tl.float32)
        heads = tl.arange(0, HEADS_PAD)[:, None]
        first = rows + row * stride_row + heads * (2 * HALF) + half[None, :]  # (HEADS_PAD, HALF): first halves
        inside = heads < HEADS
        x_1 = tl.load(first, mask=inside, other=0.0).to(tl.float32)
        x_2 = tl.load(first + HALF, mask=inside, other=0.0).to(tl.float32)
        # rotate_half(x) = (-x_2, x_1): x·cos + rotate_half(x)·sin, by halves
        tl.store(first, (x_1 * cos_1[None, :] - x_2 * sin_1[None, :]).to(rows.dtype.element_ty), mask=inside)
        tl.store(first + HALF, (x_2 * cos_2[None, :] + x_1 * sin_2[None, :]).to(rows.dtype.element_ty), mask=inside)

    return _rotary


@functools.cache
def _swiglu_kernel():
    """The Triton kernel, defined on first use so that importing this module needs no triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu(fused, output, width, stride_fused, stride_output, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < width
        gate = tl.load(fused + row * stride_fused + columns, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(fused + row * stride_fused + width + columns, mask=inside, other=0.0)
        activation = (gate * tl.sigmoid(gate)).to(up.dtype)
        tl.store(output + row * stride_output + columns, activation * up, mask=inside)

    return _swiglu

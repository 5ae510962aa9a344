"""The Triton kernels of fused_projections.py (SwiGLU over a fused gate/up output, rotary in place in a fused q/k/v
output) on CPU under Triton's interpreter, against their torch references.

Not collected on its own: `test_fused_projections.py` runs this file in a child pytest with TRITON_INTERPRET=1 set
before triton is first imported (as test_split_kv_decode.py runs interpreted_split_kv.py)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from SPA_agent.generators import fused_projections

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run with TRITON_INTERPRET=1")

# (leading shape, intermediate size I, block): a decode batch, and prefill rows; I not a multiple of the block
SWIGLU_SHAPES = [((7,), 100, 64), ((2, 5), 1536, 512), ((3,), 40, 16)]
# (batch, tokens, query heads, key/value heads, head size, model type): SmolLM2's 9/3 heads of 64 (12 rotated heads,
# padded to 16 in the kernel), the tiny model's 4/2 of 32 (Qwen2), a decode step (one token)
ROTARY_SHAPES = [(3, 5, 9, 3, 64, "llama"), (2, 7, 4, 2, 32, "qwen2"), (4, 1, 9, 3, 64, "llama")]


@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=lambda s: f"rows{'x'.join(map(str, s[0]))}_i{s[1]}_block{s[2]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_kernel_equals_the_torch_fallback(shape, dtype):
    leading, width, block = shape
    fused = (3 * torch.randn(*leading, 2 * width, generator=torch.Generator().manual_seed(width))).to(dtype)
    output = fused_projections.swiglu_triton(fused, block=block)
    assert output.shape == (*leading, width) and output.dtype == dtype
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(output, fused_projections.swiglu_torch(fused), **tolerance)


def test_swiglu_kernel_reads_rows_at_their_stride():
    fused = torch.randn(6, 2 * 100 + 8, generator=torch.Generator().manual_seed(1))[:, 4:204]  # strided rows
    torch.testing.assert_close(fused_projections.swiglu_triton(fused, block=64), fused_projections.swiglu_torch(fused),
                               atol=1e-6, rtol=1e-6)


def rotary_inputs(batch, tokens, heads, kv_heads, head_dim, per_row: bool):
    """A fused q/k/v output (B, T, (H + 2·H_kv)·D) and transformers' default cos, sin at per-row positions (B, T, D)
    (a decode step's rows at other lengths) or shared positions (1, T, D)."""
    gen = torch.Generator().manual_seed(batch * 100 + head_dim)
    fused = torch.randn(batch, tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 500, (batch if per_row else 1, tokens), generator=gen)
    inverse = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions[..., None].float() * inverse
    angles = torch.cat([angles, angles], dim=-1)
    return fused, angles.cos(), angles.sin()


@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=lambda s: "b{}_t{}_h{}_kv{}_d{}_{}".format(*s))
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
def test_rotary_kernel_equals_transformers_rotary(shape, per_row):
    batch, tokens, heads, kv_heads, head_dim, model_type = shape
    modeling = importlib.import_module(fused_projections.MODEL_MODULES[model_type])
    fused, cos, sin = rotary_inputs(batch, tokens, heads, kv_heads, head_dim, per_row)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    query, key, value = (part.view(batch, tokens, -1, head_dim).transpose(1, 2) for part in fused.split(sizes, -1))
    expected_query, expected_key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
    expected_value = value.clone()
    fused_projections.rotary_triton(fused, cos, sin, heads + kv_heads)
    torch.testing.assert_close(query, expected_query, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(key, expected_key, atol=1e-5, rtol=1e-5)
    assert torch.equal(value, expected_value)  # the values are not rotated

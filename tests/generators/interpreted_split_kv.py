"""The Triton split-KV decode kernels (split_kv_decode.py) on CPU under Triton's interpreter: their arithmetic against
the masked reference, and the static decoder's samples with them against its CPU attention.

Not collected on its own: `test_split_kv_decode.py` runs this file in a child pytest with TRITON_INTERPRET=1 set
before triton is first imported (Triton's standard functions are interpreted only then, and torch may import
triton earlier in a test session)."""

from __future__ import annotations

import os

import pytest
import torch

from SPA_agent.generators import SamplingParams, split_kv_decode
from SPA_agent.generators.hf import HFGenerator
from SPA_agent.generators.static_decode import masked_decode

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run with TRITON_INTERPRET=1")

# (batch, query heads, key/value heads, head size, cache length): SmolLM2's 9/3 heads, Qwen2.5-0.5B's 14/2 (G = 7),
# no grouping, one key/value head for eight, and lengths on, just past and far from split and block boundaries
SHAPES = [(5, 9, 3, 64, 600), (3, 14, 2, 64, 300), (4, 4, 4, 32, 257), (2, 8, 1, 16, 70)]


def decode_inputs(batch, heads, kv_heads, head_dim, length, device="cpu", dtype=torch.float32):
    """Decode queries (B, H, 1, D) laid out as a model's attention hands them over (a transposed view), a cache
    (B, L, H_kv, D), and row lengths from one key (a finished row) to the whole cache."""
    gen = torch.Generator().manual_seed(batch * 1000 + length)
    query = torch.randn(batch, 1, heads, head_dim, generator=gen).transpose(1, 2)
    key, value = (torch.randn(batch, length, kv_heads, head_dim, generator=gen) for _ in range(2))
    kv_lengths = torch.randint(1, length + 1, (batch,), generator=gen, dtype=torch.int32)
    kv_lengths[0], kv_lengths[-1] = 1, length
    to = dict(device=device, dtype=dtype)
    return query.to(**to), key.to(**to), value.to(**to), kv_lengths.to(device)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_h{}_kv{}_d{}_l{}".format(*s))
def test_kernels_equal_the_masked_reference(shape):
    query, key, value, kv_lengths = decode_inputs(*shape)
    output = split_kv_decode.split_kv_decode(query, key, value, kv_lengths, scaling=0.3)
    assert output.shape == (shape[0], 1, shape[1], shape[3])
    torch.testing.assert_close(output, masked_decode(query, key, value, kv_lengths, scaling=0.3),
                               atol=1e-5, rtol=1e-5)


def test_keys_past_a_rows_length_are_never_read():
    query, key, value, kv_lengths = decode_inputs(3, 9, 3, 64, 600)
    before = split_kv_decode.split_kv_decode(query, key, value, kv_lengths)
    for row, length in enumerate(kv_lengths.tolist()):
        key[row, length:], value[row, length:] = float("nan"), float("nan")
    torch.testing.assert_close(split_kv_decode.split_kv_decode(query, key, value, kv_lengths), before)


def generations(model, tokenizer, prompts, sampling, attention):
    generator = HFGenerator(model, tokenizer, sampling, batch_size=None, decoder="static", progress=False,
                            decode_attention=attention)
    return [(g.token_ids, g.finish_reason) for g in generator.generate(prompts)]


@pytest.mark.slow
def test_decoder_samples_what_it_samples_with_the_masked_attention(varied_model, tiny_tokenizer,
                                                                  prompts_of_lengths):
    """The static decoder with the split-KV kernel in every layer samples the same tokens (float32, temperature 1,
    one seed) as with its CPU attention; rows finish at different steps, so finished rows' one-key reads are in."""
    prompts = prompts_of_lengths([1, 12, 3, 40])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    expected = generations(varied_model, tiny_tokenizer, prompts, sampling, "flash")
    assert generations(varied_model, tiny_tokenizer, prompts, sampling, "split_kv") == expected

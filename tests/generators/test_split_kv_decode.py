"""The Triton split-KV decode attention (split_kv_decode.py, `generator.decode_attention=split_kv`): on CPU under
Triton's interpreter, the kernels' arithmetic against the masked reference and the static decoder's samples with it
against the decoder's own CPU path; on a GPU, the compiled kernels and the CUDA-graph decoder."""

from __future__ import annotations

import copy

import pytest
import torch

from SPA_agent.generators import SamplingParams, split_kv_decode
from SPA_agent.generators.hf import HFGenerator
from SPA_agent.generators.static_decode import StaticDecoder, masked_decode

pytestmark = pytest.mark.skipif(not split_kv_decode.available(), reason="needs triton (pip install triton)")

# (batch, query heads, key/value heads, head size, cache length): SmolLM2's 9/3 heads, Qwen2.5-0.5B's 14/2 (G = 7),
# no grouping, one key/value head for eight, and lengths on, just past and far from split and block boundaries
SHAPES = [(5, 9, 3, 64, 600), (3, 14, 2, 64, 300), (4, 4, 4, 32, 257), (2, 8, 1, 16, 70)]


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter (kernels run on CPU tensors); the kernels are defined afresh under it and again after."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    split_kv_decode._kernels.cache_clear()
    yield
    split_kv_decode._kernels.cache_clear()


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
def test_kernels_equal_the_masked_reference(interpreted, shape):
    query, key, value, kv_lengths = decode_inputs(*shape)
    output = split_kv_decode.split_kv_decode(query, key, value, kv_lengths, scaling=0.3)
    assert output.shape == (shape[0], 1, shape[1], shape[3])
    torch.testing.assert_close(output, masked_decode(query, key, value, kv_lengths, scaling=0.3),
                               atol=1e-5, rtol=1e-5)


def test_keys_past_a_rows_length_are_never_read(interpreted):
    query, key, value, kv_lengths = decode_inputs(3, 9, 3, 64, 600)
    before = split_kv_decode.split_kv_decode(query, key, value, kv_lengths)
    for row, length in enumerate(kv_lengths.tolist()):
        key[row, length:], value[row, length:] = float("nan"), float("nan")
    torch.testing.assert_close(split_kv_decode.split_kv_decode(query, key, value, kv_lengths), before)


def test_unsupported_head_sizes_and_layouts_are_one_line_errors():
    query, key, value, kv_lengths = decode_inputs(2, 4, 2, 24, 40)
    with pytest.raises(ValueError, match="power-of-two head size of at least 16, got 24"):
        split_kv_decode.split_kv_decode(query, key, value, kv_lengths)
    query, key, value, kv_lengths = decode_inputs(2, 4, 2, 32, 40)
    with pytest.raises(ValueError, match="keys and values of one layout"):
        split_kv_decode.split_kv_decode(query, key, value.transpose(1, 2).contiguous().transpose(1, 2), kv_lengths)
    with pytest.raises(ValueError, match=r"decode attention must be one of \('flash', 'split_kv'\), got 'paged'"):
        StaticDecoder(torch.nn.Linear(1, 1), stop_ids=[0], pad_id=0, attention="paged")


def generations(model, tokenizer, prompts, sampling, attention):
    generator = HFGenerator(model, tokenizer, sampling, batch_size=None, decoder="static", progress=False,
                            decode_attention=attention)
    return [(g.token_ids, g.finish_reason) for g in generator.generate(prompts)]


@pytest.mark.slow
def test_decoder_samples_what_it_samples_with_the_masked_attention(interpreted, varied_model, tiny_tokenizer,
                                                                  prompts_of_lengths):
    """The static decoder with the split-KV kernel in every layer samples the same tokens (float32, temperature 1,
    one seed) as with its CPU attention; rows finish at different steps, so finished rows' one-key reads are in."""
    prompts = prompts_of_lengths([1, 12, 3, 40])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    expected = generations(varied_model, tiny_tokenizer, prompts, sampling, "flash")
    assert generations(varied_model, tiny_tokenizer, prompts, sampling, "split_kv") == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES[:2], ids=["smollm2", "qwen0.5b"])
def test_kernels_on_gpu_equal_the_masked_reference(shape):
    query, key, value, kv_lengths = decode_inputs(*shape, device="cuda", dtype=torch.bfloat16)
    output = split_kv_decode.split_kv_decode(query, key, value, kv_lengths, scaling=0.125)
    reference = masked_decode(query.float(), key.float(), value.float(), kv_lengths, scaling=0.125)
    torch.testing.assert_close(output.float(), reference, atol=2e-2, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the compiled kernels need a CUDA GPU")
def test_cuda_graph_decoder_on_gpu_samples_what_the_masked_attention_samples(varied_model, tiny_tokenizer,
                                                                             prompts_of_lengths):
    """float32 on the GPU (the kernels' products in IEEE float32), every decode step a CUDA-graph replay: the same
    greedy tokens and finish reasons as the masked attention, which float32 decoding runs."""
    model = copy.deepcopy(varied_model).to("cuda")
    prompts = prompts_of_lengths([1, 2, 3, 5, 8, 12, 20, 40])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    assert (generations(model, tiny_tokenizer, prompts, greedy, "split_kv")
            == generations(model, tiny_tokenizer, prompts, greedy, "flash"))

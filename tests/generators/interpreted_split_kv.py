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


#: launch parameters other than the decoder's (benchmarks/decode_attention_kernels.py sweeps them): smaller splits and
#: blocks, other warps and stages; the grid capped at one program a row and head, and at 3 programs that each read
#: every third 64-key chunk (a row of 300 keys: 5 chunks), with the heads first in the grid
LAUNCHES = {"split64_block16_warps2_stages2": dict(split=64, block_n=16, num_warps=2, num_stages=2),
            "one_program_a_row": dict(max_splits=1),
            "capped_at_3_heads_first": dict(split=64, block_n=32, max_splits=3, heads_first=True)}


def nan_past_lengths(key, value, kv_lengths):
    """NaN in every key and value past its row's length (a read of one turns the output to NaN)."""
    for row, length in enumerate(kv_lengths.tolist()):
        key[row, length:], value[row, length:] = float("nan"), float("nan")


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_launch_parameters_give_the_masked_reference_and_read_nothing_past_a_row(launch):
    query, key, value, kv_lengths = decode_inputs(4, 9, 3, 64, 300)
    reference = masked_decode(query, key, value, kv_lengths, scaling=0.3)
    nan_past_lengths(key, value, kv_lengths)
    output = split_kv_decode.split_kv_decode(query, key, value, kv_lengths, scaling=0.3, **LAUNCHES[launch])
    torch.testing.assert_close(output, reference, atol=1e-5, rtol=1e-5)


def test_default_launch_parameters_are_the_module_constants(monkeypatch):
    """None stands for the module's constants, read at the call: the decoder's kernel, and what a benchmark sets."""
    query, key, value, kv_lengths = decode_inputs(3, 4, 2, 16, 200)
    explicit = split_kv_decode.split_kv_decode(query, key, value, kv_lengths, split=64, block_n=32, max_splits=2)
    monkeypatch.setattr(split_kv_decode, "SPLIT", 64)
    monkeypatch.setattr(split_kv_decode, "BLOCK_N", 32)
    monkeypatch.setattr(split_kv_decode, "MAX_SPLITS", 2)
    assert torch.equal(split_kv_decode.split_kv_decode(query, key, value, kv_lengths), explicit)


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


# --- split_kv_shared (shared_prefix_decode.py): a prefix that a group of rows shares read once ---------------------
#: (query heads, key/value heads, head size, cache length, groups (leader first), per row its shared keys and kv
#: length): a group of 8 over more than a split (SmolLM2's 9/3 heads), members sharing less than their leader, a
#: finished member; Qwen2.5-0.5B's G = 7 (56 query rows a group), a prefix of exactly one split and of kv length - 1,
#: a finished leader; no grouping with the leader not the first row; a group whose every member has finished
SHARED_CASES = {
    "smollm2_group_of_8": (9, 3, 64, 600, [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9]],
                           [300, 300, 250, 300, 290, 300, 300, 300, 70, 65, 0],
                           [301, 1, 400, 600, 291, 350, 512, 513, 71, 66, 600]),
    "qwen_g7_finished_leader": (14, 2, 64, 300, [[0, 1, 2], [3, 4]], [256, 200, 256, 100, 100, 0],
                                [257, 300, 1, 1, 150, 77]),
    "no_gqa_leader_not_first": (4, 4, 32, 257, [[1, 0, 2]], [64, 64, 64], [65, 257, 130]),
    "one_kv_head_all_finished": (8, 1, 16, 70, [[0, 1], [2, 3]], [69, 69, 64, 64], [70, 70, 1, 1]),
}


def shared_inputs(heads, kv_heads, head_dim, length, groups, shared, kv_lengths, dtype=torch.float32):
    """Decode queries and a cache in which each member's first `shared` keys and values are its leader's (so the
    masked reference, reading every row's own keys, is what reading the leader's gives), and the prefix tables."""
    from SPA_agent.generators.shared_prefix_decode import PrefixTables

    batch = len(shared)
    query, key, value, _ = decode_inputs(batch, heads, kv_heads, head_dim, length)
    for group in groups:
        for member in group:
            key[member, : shared[member]] = key[group[0], : shared[member]]
            value[member, : shared[member]] = value[group[0], : shared[member]]
    tables = PrefixTables(batch, torch.device("cpu"))
    tables.fill(shared, groups)
    return (query.to(dtype), key.to(dtype), value.to(dtype), torch.tensor(kv_lengths, dtype=torch.int32),
            tables.tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("case", list(SHARED_CASES))
def test_shared_prefix_kernels_equal_the_masked_reference(case, dtype):
    """(bfloat16 only on a GPU: Triton's interpreter turns bfloat16 tensors to garbage, split_kv's kernels' too.)"""
    from SPA_agent.generators.shared_prefix_decode import shared_prefix_decode

    query, key, value, kv_lengths, tables = shared_inputs(*SHARED_CASES[case], dtype=dtype)
    output = shared_prefix_decode(query, key, value, kv_lengths, tables, scaling=0.3)
    reference = masked_decode(query.float(), key.float(), value.float(), kv_lengths, scaling=0.3)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.float(), reference, atol=tolerance, rtol=tolerance)


def test_shared_prefix_is_read_from_the_leader_and_nothing_past_a_rows_length():
    """NaN in every member's own copy of its shared prefix and past every row's length: the output is unchanged."""
    from SPA_agent.generators.shared_prefix_decode import shared_prefix_decode

    heads, kv_heads, head_dim, length, groups, shared, lengths = SHARED_CASES["smollm2_group_of_8"]
    query, key, value, kv_lengths, tables = shared_inputs(heads, kv_heads, head_dim, length, groups, shared, lengths)
    before = shared_prefix_decode(query, key, value, kv_lengths, tables)
    for group in groups:
        for member in group[1:]:
            prefix = min(shared[member], lengths[member] - 1)
            key[member, :prefix], value[member, :prefix] = float("nan"), float("nan")
    for row, row_length in enumerate(lengths):
        key[row, row_length:], value[row, row_length:] = float("nan"), float("nan")
    torch.testing.assert_close(shared_prefix_decode(query, key, value, kv_lengths, tables), before)


#: (case, launch): other splits, blocks, warps and stages, the grid capped at 2 programs per group (or row) and head,
#: each reading every other chunk of the prefix and of the row's own keys (5 chunks of 128 keys; a finished leader
#: with chunks of 64)
SHARED_LAUNCHES = {"smollm2_split128_block32_warps2_stages2_capped": (
                       "smollm2_group_of_8", dict(split=128, block_n=32, num_warps=2, num_stages=2, max_splits=2)),
                   "qwen_finished_leader_split64_capped": (
                       "qwen_g7_finished_leader", dict(split=64, block_n=32, max_splits=2))}


@pytest.mark.parametrize(("case", "launch"), list(SHARED_LAUNCHES.values()), ids=list(SHARED_LAUNCHES))
def test_shared_prefix_launch_parameters_give_the_masked_reference(case, launch):
    """NaN in the members' own prefix copies and past every key a row reads (its length; a leader's, its members'
    prefixes too): none is read."""
    from SPA_agent.generators.shared_prefix_decode import shared_prefix_decode

    heads, kv_heads, head_dim, length, groups, shared, lengths = SHARED_CASES[case]
    query, key, value, kv_lengths, tables = shared_inputs(*SHARED_CASES[case])
    reference = masked_decode(query, key, value, kv_lengths, scaling=0.3)
    read = list(lengths)
    for group in groups:
        prefixes = [min(shared[member], lengths[member] - 1) for member in group]
        read[group[0]] = max(read[group[0]], *prefixes)
        for member, prefix in zip(group[1:], prefixes[1:]):
            key[member, :prefix], value[member, :prefix] = float("nan"), float("nan")
    nan_past_lengths(key, value, torch.tensor(read))
    output = shared_prefix_decode(query, key, value, kv_lengths, tables, scaling=0.3, **launch)
    torch.testing.assert_close(output, reference, atol=1e-5, rtol=1e-5)


def grouped_prompts(make_prompt) -> list:
    """Rows in a group as a PPO batch has them: two identical prompts (the tiny model ends their turn after 13
    greedy tokens), one that shares all but its last ids with those, and a short prompt alone (below the shortest
    shared prefix)."""
    grid = "######\n#O####\n#XP###\n#__###\n######\n"
    return [make_prompt(text) for text in [grid * 4 + "You", grid * 4 + "Up", grid * 4 + "You", "Short"]]


@pytest.mark.slow
def test_decoder_with_shared_prefixes_samples_what_its_cpu_attention_samples(varied_model, tiny_tokenizer,
                                                                            make_prompt, monkeypatch):
    """split_kv_shared in every layer (float32, greedy; the identical prompts prefilled once, their keys copied)
    emits the tokens and finish reasons of the CPU's masked attention, which split_kv's emits too (the test above),
    while a group's members finish at different steps. (Against the masked attention rather than split_kv under the
    interpreter: that run alone would take ~10 s more.)"""
    from SPA_agent.generators.shared_prefix_decode import PrefixTables

    fills = []
    real_fill = PrefixTables.fill
    monkeypatch.setattr(PrefixTables, "fill", lambda self, shared, groups: (fills.append((shared, groups)),
                                                                             real_fill(self, shared, groups)))
    prompts = grouped_prompts(make_prompt)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=14)
    expected = generations(varied_model, tiny_tokenizer, prompts, greedy, "flash")
    assert [reason for _, reason in expected] == ["stop", "length", "stop", "length"]
    assert generations(varied_model, tiny_tokenizer, prompts, greedy, "split_kv_shared") == expected
    # the decode batch in length order (Short, You, Up, You): the Yous share their 88 ids, Up its first 76 with them
    assert fills == [([0, 88, 76, 88], [[1, 3, 2]])]

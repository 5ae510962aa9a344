"""Micro-batch plans and the packed loss: packed == padded == one sample at a time, no cross-sample attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sft_fixtures import synthetic_rows, write_rows

from sft.packing import (
    IGNORE_INDEX,
    collate_packed,
    collate_padded,
    count_loss_tokens,
    plan_packed,
    plan_padded,
    token_loss_sum,
)
from sft.spa_sft_dataset import SpaSftDataset


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=24), world=st.integers(1, 4),
       budget=st.integers(50, 120))
def test_packed_plan_covers_every_sample_once_within_budget_and_equal_counts(lengths, world, budget):
    plan = plan_packed(list(range(len(lengths))), lengths, world, budget)
    assert len({len(rank) for rank in plan}) == 1
    flat = sorted(i for rank in plan for micro in rank for i in micro)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in micro) <= budget for rank in plan for micro in rank)


def test_padded_plan_is_the_original_micro_batches():
    plan = plan_padded([5, 2, 7, 1, 0, 3, 4, 6], [10] * 8, world_size=2, micro_batch_size=2)
    assert sorted(sorted(m) for rank in plan for m in rank) == [[0, 3], [1, 7], [2, 5], [4, 6]]
    assert [len(rank) for rank in plan] == [2, 2]


def test_oversized_sample_is_refused():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=8"):
        plan_packed([0], [9], 1, 8)


@pytest.fixture(scope="module")
def samples(tiny_tokenizer, tmp_path_factory):
    prompts, responses = synthetic_rows(5, seed=3)
    prompts[1] = prompts[1] + [{"role": "assistant", "content": "<answer>Up</answer>"},
                               {"role": "user", "content": "Turn 2:\nState:\n#P_#\n"}]
    path = write_rows(tmp_path_factory.mktemp("pack") / "rows.parquet", prompts, responses)
    return SpaSftDataset(str(path), tiny_tokenizer).samples


def _load(tiny_dir, attn: str):
    """The tiny model as the SFT trainer loads it, float32, with `model.attn_implementation=attn`."""
    from omegaconf import OmegaConf

    from sft.fsdp_model import load_model

    cfg = OmegaConf.create({"attn_implementation": attn, "trust_remote_code": False,
                            "enable_gradient_checkpointing": False})
    return load_model(str(tiny_dir), cfg, vocab_size=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "packed_sdpa"])
def test_packed_padded_and_single_sample_losses_agree(tiny_dir, samples, attn):
    from SPA_agent.trainer.packing import PACKED_ATTENTION

    model = _load(tiny_dir, attn)
    assert (model.config._attn_implementation == PACKED_ATTENTION) == (attn == "packed_sdpa")
    pad = 0
    with torch.no_grad():
        single = sum(token_loss_sum(model, collate_packed([s], pad)) for s in samples)
        packed_batch = collate_packed(samples, pad)
        packed = token_loss_sum(model, packed_batch)
        padded_batch = collate_padded(samples, pad)
        padded = token_loss_sum(model, padded_batch)
    n_tokens = sum(int(s.loss_mask.sum()) for s in samples)
    assert count_loss_tokens(packed_batch) == count_loss_tokens(padded_batch) == n_tokens
    torch.testing.assert_close(packed, single, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(padded, single, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", "packed_sdpa"])
def test_packed_samples_do_not_attend_to_each_other(tiny_dir, samples, attn):
    """Changing the first packed sample must leave the second sample's logits unchanged."""
    model = _load(tiny_dir, attn)
    first, second = samples[0], samples[1]
    altered = type(first)(torch.flip(first.input_ids, [0]), first.loss_mask)
    with torch.no_grad():
        logits = [model(**{k: v for k, v in collate_packed([a, second], 0).items() if k != "labels"},
                        use_cache=False).logits[0, len(a):] for a in (first, altered)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_empty_micro_batch_has_no_loss_tokens(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    batch = collate_packed([], pad_id=0)
    assert count_loss_tokens(batch) == 0
    assert token_loss_sum(model, batch).item() == 0.0


@pytest.mark.parametrize("pad_to_multiple, width", [(0, 1), (64, 64)])
def test_empty_micro_batch_is_one_untrained_filler_segment(pad_to_multiple, width):
    """A rank with fewer bins than another gets an empty micro-batch (`_balance`); with pad_to_multiple > 0
    (flex attention's 512 on GPU) it used to be 0 tokens wide and torch.cat([]) failed on that rank."""
    batch = collate_packed([], pad_id=7, pad_to_multiple=pad_to_multiple)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "input_ids": (1, width), "position_ids": (1, width), "labels": (1, width)}
    assert batch["input_ids"].eq(7).all()
    assert batch["position_ids"].tolist() == [list(range(width))]
    assert batch["labels"].eq(IGNORE_INDEX).all()
    assert count_loss_tokens(batch) == 0


def test_padded_rows_round_up_to_the_multiple(samples):
    total = len(samples[0]) + len(samples[1])
    batch = collate_packed(samples[:2], pad_id=0, pad_to_multiple=64)
    assert batch["input_ids"].shape == (1, -(-total // 64) * 64)
    assert count_loss_tokens(batch) == count_loss_tokens(collate_packed(samples[:2], pad_id=0))

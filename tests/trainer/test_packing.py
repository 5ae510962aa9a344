"""Token-budget plans and packed (padding-free) micro-batches of the local backend give the padded path's
log-probs, values, losses and gradients (issue 17): the padded micro-batch-1 path is the reference."""

from __future__ import annotations

import pytest
import torch

from SPA_agent.trainer.local_backend import models as lm
from SPA_agent.trainer.local_backend.backend import LocalBackend
from SPA_agent.trainer.packing import (
    PackedRows,
    avoid_cudnn_attention,
    micro_batch_plan,
    packed_segments,
    plan_by_count,
    plan_by_tokens,
)

REFERENCE = ("use_dynamic_bsz=False", "micro_batch_size_per_gpu=1", "actor_rollout_ref.model.use_remove_padding=False",
             "critic.model.use_remove_padding=False")
#: 5 trajectories of 14, 11, 9, 14, 6 real tokens: budget 24 packs some of them together, never all; with
#: gradient checkpointing (the default), whose recomputation must see the packed segments too
PACKED = ("use_dynamic_bsz=True", "ppo_max_token_len_per_gpu=24", "log_prob_max_token_len_per_gpu=24",
          "actor_rollout_ref.model.use_remove_padding=True", "critic.model.use_remove_padding=True",
          "actor_rollout_ref.model.enable_gradient_checkpointing=True",
          "critic.model.enable_gradient_checkpointing=True")
LENGTHS = (14, 11, 9, 14, 6)
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _vocabulary_projection_in_chunks(monkeypatch, tiny_tokenizer):
    """Packed log-probs project 5 positions at a time onto the vocabulary (checkpointed chunks, as on GPU)."""
    monkeypatch.setattr(lm, "LOGIT_ELEMENTS", 5 * len(tiny_tokenizer))


def ragged_batch(make_batch):
    """A rollout-shaped batch with 5 rows of LENGTHS real tokens (left padded), loss_mask on real positions only."""
    batch = make_batch(rows=len(LENGTHS), length=max(LENGTHS))
    t = batch.batch
    for row, n in enumerate(LENGTHS):
        t["attention_mask"][row] = 0
        t["attention_mask"][row, -n:] = 1
    t["input_ids"].masked_fill_(t["attention_mask"] == 0, 0)
    t["position_ids"] = (t["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    t["responses"] = t["input_ids"][:, 1:]
    both_real = (t["attention_mask"][:, :-1] * t["attention_mask"][:, 1:]).float()
    t["loss_mask"] = t["loss_mask"] * both_real
    t["response_mask"] = t["loss_mask"].clone()
    return batch


def test_avoid_cudnn_attention_leaves_sdpa_without_cudnn_only():
    """cuDNN SDPA builds a plan per sequence length (seconds per PPO step with real rollouts); the other
    backends stay available."""
    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        avoid_cudnn_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled()) == before[1:]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before[0])


@pytest.mark.parametrize("positions, segments", [
    ([0, 1, 2, 0, 1, 0, 1, 2, 3], (3, 2, 4)),
    ([0, 1, 2, 0], (3, 1)),
    ([4, 5, 6, 0, 1], (3, 2)),  # a sequence need not start at position 0 (transformers' rule: any break)
    ([0, 1, 2, 3], None),  # one sequence: not packed
    ([7, 8, 9], None),
])
def test_packed_segments_split_a_row_where_positions_break(positions, segments):
    position_ids = torch.tensor([positions])
    assert packed_segments(position_ids, len(positions), len(positions)) == segments
    assert packed_segments(position_ids, len(positions), len(positions)) == segments  # read back from the memo


def test_packed_segments_only_for_one_row_of_queries_over_its_own_keys():
    assert packed_segments(None, 4, 4) is None
    assert packed_segments(torch.tensor([[0, 1, 0, 1], [0, 1, 0, 1]]), 4, 4) is None  # two rows
    assert packed_segments(torch.tensor([[0, 1, 0, 1]]), 1, 4) is None  # a decoding step over a cache
    assert packed_segments(torch.tensor([[0, 1, 0, 1]]), 4, 6) is None


def test_plan_by_count_is_consecutive_rows():
    assert plan_by_count(5, 2) == [[0, 1], [2, 3], [4]]


def test_plan_by_tokens_first_fit_decreasing_with_oversize_rows_alone():
    # 20 > 12 fills a bin alone; then 9, 7, 5 (joins 7), 3 (joins 9)
    assert plan_by_tokens([5, 9, 3, 7, 20], 12) == [[4], [1, 2], [0, 3]]
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    assert micro_batch_plan(mask, 2, dynamic=True, budget=4) == [[1, 2], [0]]
    assert micro_batch_plan(mask, 2, dynamic=False, budget=4) == [[0, 1], [2]]


def test_packed_rows_concatenate_real_tokens_and_unpack_to_their_columns():
    micro = {"input_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]]),
             "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
             "position_ids": torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]])}
    rows = PackedRows.pack(micro)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 4]]
    assert rows.position_ids.tolist() == [[0, 1, 0, 1, 2, 3]]
    assert rows.segments == (2, 4)
    keep = rows.next_token_positions()
    assert keep.tolist() == [True, False, True, True, True, False]
    unpacked = rows.unpack(torch.arange(1.0, 7.0), keep)  # column j: about token j+1
    assert unpacked.tolist() == [[0, 0, 1], [3, 4, 5]]


def test_packed_log_probs_and_values_equal_padded(ppo_config, tiny_tokenizer, make_batch):
    batch = ragged_batch(make_batch)
    t = batch.batch
    both_real = (t["attention_mask"][:, :-1] * t["attention_mask"][:, 1:]).bool()
    assert len(micro_batch_plan(t["attention_mask"], 1, True, 24)) == 3  # packing happens: 5 rows, 3 rows
    outputs = []
    for overrides in (REFERENCE, PACKED):
        backend = LocalBackend(ppo_config("_2_sokoban", *overrides, "actor_rollout_ref.rollout.temperature=0.7"),
                               tiny_tokenizer)
        log_probs = backend.compute_log_prob(batch).batch
        outputs.append((log_probs["old_log_probs"], log_probs["entropys"],
                        backend.compute_ref_log_prob(batch).batch["ref_log_prob"],
                        backend.compute_values(batch).batch["values"]))
    for reference, packed in zip(*outputs):
        torch.testing.assert_close(packed[both_real], reference[both_real], **TOL)
        assert (packed[~both_real] == 0).all()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm", "token-sum"])
def test_packed_updates_equal_micro_batch_1(ppo_config, tiny_tokenizer, make_batch, agg, monkeypatch):
    """Actor loss, entropy and KL loss, critic loss, and every parameter's gradient: packed token-budget
    micro-batches against padded micro-batches of one trajectory, for every loss_agg_mode verl's agg_loss has.
    The packed run must pack what the token budget plans (so an update that ignored packing fails here)."""
    packed_rows = []
    real_pack = PackedRows.pack.__func__
    monkeypatch.setattr(PackedRows, "pack", classmethod(
        lambda cls, micro: packed_rows.append(micro["attention_mask"].sum(-1).tolist()) or real_pack(cls, micro)))
    metrics, grads = [], []
    for overrides in (REFERENCE, PACKED):
        cfg = ppo_config("_2_sokoban", *overrides, "ppo_mini_batch_size=5", "actor_rollout_ref.actor.use_kl_loss=True",
                         "actor_rollout_ref.actor.kl_loss_coef=0.1", f"actor_rollout_ref.actor.loss_agg_mode={agg}",
                         f"critic.loss_agg_mode={agg}")
        backend = LocalBackend(cfg, tiny_tokenizer)
        batch = ragged_batch(make_batch)
        g = torch.Generator().manual_seed(1)
        batch.batch["advantages"] = torch.randn(batch.batch["loss_mask"].shape, generator=g)
        batch.batch["returns"] = torch.randn(batch.batch["loss_mask"].shape, generator=g)
        with torch.no_grad():  # old log-probs/values from the reference path: both updates see the same inputs
            mb = {k: batch.batch[k] for k in lm.MODEL_INPUT_KEYS}
            batch.batch["old_log_probs"] = lm.token_log_probs(backend.actor.model, mb, 1.0, False)[0] + 0.05
            batch.batch["ref_log_prob"] = batch.batch["old_log_probs"] - 0.1
            batch.batch["values"] = torch.zeros_like(batch.batch["returns"]) + 0.3
        grads.append(record_gradients(backend, monkeypatch))
        packed_rows.clear()
        metrics.append({**backend.update_critic(batch), **backend.update_actor(batch)})
    # the packed run: the budget of 24 tokens packs the 5 trajectories (14, 11, 9, 14, 6 tokens) into 3
    # micro-batches, for the critic's update and the actor's
    assert sorted(map(sorted, packed_rows)) == [[6, 14]] * 2 + [[9, 14]] * 2 + [[11]] * 2
    reference, packed = metrics
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "critic/vf_loss"):
        assert packed[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key
    for role in ("actor", "critic"):
        assert grads[0][role].keys() == grads[1][role].keys()
        assert sum(g.norm() for g in grads[0][role].values()) > 0
        for name, reference_grad in grads[0][role].items():
            torch.testing.assert_close(grads[1][role][name], reference_grad, rtol=1e-4, atol=1e-6, msg=name)


def record_gradients(backend: LocalBackend, monkeypatch) -> dict[str, dict[str, torch.Tensor]]:
    """{role: {parameter: gradient}}, filled as each role's optimizer step clips and applies its gradients."""
    grads: dict[str, dict[str, torch.Tensor]] = {"actor": {}, "critic": {}}
    for role, trainable in (("actor", backend.actor), ("critic", backend.critic)):
        def clip_and_step(trainable=trainable, real=trainable.clip_and_step, into=grads[role]):
            into.update({name: p.grad.clone() for name, p in trainable.model.named_parameters() if p.grad is not None})
            return real()
        monkeypatch.setattr(trainable, "clip_and_step", clip_and_step)
    return grads

"""Token-budget plans and packed (padding-free) micro-batches of the local backend give the padded path's
log-probs, values, losses and gradients (issue 17): the padded micro-batch-1 path is the reference."""

from __future__ import annotations

import pytest
import torch

from SPA_agent.trainer import packing
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
            # round-off scales with the gradient: token-sum's are the loss summed over ~50 tokens, not averaged
            atol = 1e-6 * max(1.0, reference_grad.abs().max().item())
            torch.testing.assert_close(grads[1][role][name], reference_grad, rtol=1e-4, atol=atol,
                                       msg=lambda m: f"{name}: {m}")


def record_gradients(backend: LocalBackend, monkeypatch) -> dict[str, dict[str, torch.Tensor]]:
    """{role: {parameter: gradient}}, filled as each role's optimizer step clips and applies its gradients."""
    grads: dict[str, dict[str, torch.Tensor]] = {"actor": {}, "critic": {}}
    for role, trainable in (("actor", backend.actor), ("critic", backend.critic)):
        def clip_and_step(trainable=trainable, real=trainable.clip_and_step, into=grads[role]):
            into.update({name: p.grad.clone() for name, p in trainable.model.named_parameters() if p.grad is not None})
            return real()
        monkeypatch.setattr(trainable, "clip_and_step", clip_and_step)
    return grads


# ------------------------------------------------------------------ one variable-length flash call on a GPU

def test_varlen_flash_serves_cuda_half_precision_only():
    query, key = torch.zeros(1, 6, 8, 64), torch.zeros(1, 2, 8, 64)
    assert not packing.varlen_flash_applies(query, key)  # CPU: the SDPA loop
    assert not packing.varlen_flash_applies(query.bfloat16(), key.bfloat16())


def test_varlen_flash_check_keeps_the_loop_where_the_kernel_fails_or_disagrees(monkeypatch):
    """The runtime check on CPU, where flash attention has no kernel: the loop stays, with one warning; a kernel
    that agrees with the loop (forward and backward) is accepted, one that does not is refused."""
    check = packing._varlen_flash_agrees.__wrapped__  # uncached
    cpu = torch.device("cpu")
    with pytest.warns(UserWarning, match=r"not used on cpu .*(NotImplementedError|RuntimeError)"):
        assert not check(cpu, torch.float32, 6, 2, 16)
    monkeypatch.setattr(packing, "varlen_flash_attention", packing._sdpa_loop)
    assert check(cpu, torch.float32, 6, 2, 16)
    monkeypatch.setattr(packing, "varlen_flash_attention", lambda *args: 1.1 * packing._sdpa_loop(*args))
    with pytest.warns(UserWarning, match="differ from the per-trajectory SDPA loop"):
        assert not check(cpu, torch.float32, 6, 2, 16)


def test_varlen_flash_check_runs_apart_from_the_callers_autograd_state(monkeypatch):
    """The first packed forward can run under no_grad or inference mode (log-prob passes) or inside activation
    checkpointing (an SFT with gradient checkpointing): the check's own backward pass still runs, and the
    checkpointed layer's gradient is untouched."""
    check = packing._varlen_flash_agrees.__wrapped__
    monkeypatch.setattr(packing, "varlen_flash_attention", packing._sdpa_loop)  # a kernel that agrees
    cpu = torch.device("cpu")
    with torch.no_grad():
        assert check(cpu, torch.float32, 6, 2, 16)
    with torch.inference_mode():
        assert check(cpu, torch.float32, 6, 2, 16)
    outcomes = []

    def layer(x):
        outcomes.append(check(cpu, torch.float32, 6, 2, 16))
        return x * x  # saves x: the backward pass recomputes the layer

    x = torch.ones(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert outcomes == [True, True]  # the forward, then its recomputation in the backward pass
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_sdpa_loop_attends_within_each_trajectory_only():
    """The CPU path: a trajectory's outputs are those of its tokens run alone (grouped heads, 6 over 2)."""
    generator = torch.Generator().manual_seed(0)
    segments = (3, 1, 5)
    query, key, value = (torch.randn(1, heads, 9, 8, generator=generator) for heads in (6, 2, 2))
    packed = packing._sdpa_loop(query, key, value, segments)
    assert packed.shape == (1, 9, 6, 8)
    start = 0
    for length in segments:
        span = slice(start, start + length)
        alone = packing._sdpa_loop(query[:, :, span], key[:, :, span], value[:, :, span], (length,))
        torch.testing.assert_close(packed[:, span], alone, rtol=0, atol=0)
        start += length


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's variable-length kernel needs a GPU")
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_varlen_flash_equals_the_sdpa_loop_forward_and_backward(heads, kv_heads, head_dim, dtype):
    """The layouts of SmolLM2, Qwen2.5-0.5B/1.5B and the embedded models: the runtime check accepts the kernel,
    and outputs and input gradients match the per-trajectory loop on rows of uneven trajectories."""
    assert packing._varlen_flash_agrees(torch.device("cuda", torch.cuda.current_device()), dtype, heads,
                                        kv_heads, head_dim)
    generator = torch.Generator(device="cuda").manual_seed(1)
    segments = (700, 1, 33, 1290, 64)
    length = sum(segments)
    inputs = [torch.randn(1, n, length, head_dim, generator=generator, device="cuda", dtype=dtype)
              for n in (heads, kv_heads, kv_heads)]
    grad_output = torch.randn(1, length, heads, head_dim, generator=generator, device="cuda", dtype=dtype)
    results = []
    for attend in (packing.varlen_flash_attention, packing._sdpa_loop):
        leaves = [x.detach().requires_grad_() for x in inputs]
        output = attend(*leaves, segments, head_dim ** -0.5)
        output.backward(grad_output)
        results.append([output, *(leaf.grad for leaf in leaves)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's variable-length kernel needs a GPU")
def test_gpu_packed_model_uses_one_varlen_call_a_layer(tiny_dir, monkeypatch):
    """A packed forward and backward of the embedded model on a GPU as the passes run it (float32 weights under bf16
    autocast): one flash call per layer (not one per trajectory), and the loss and every parameter's gradient as
    with the SDPA loop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).cuda()
    packing.enable_packed_attention(model)
    segments = (40, 3, 77)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (1, sum(segments)), generator=generator).cuda()
    position_ids = torch.cat([torch.arange(n) for n in segments])[None].cuda()

    def loss_and_grads():
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                           **{packing.SEGMENTS_KWARG: segments}).logits
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_and_grads()  # the first packed forward runs the once-per-layout check, which calls the kernel itself
    calls = []
    varlen = packing.varlen_flash_attention
    monkeypatch.setattr(packing, "varlen_flash_attention", lambda *a: calls.append(1) or varlen(*a))
    loss, grads = loss_and_grads()
    assert len(calls) == model.config.num_hidden_layers
    monkeypatch.setattr(packing, "varlen_flash_applies", lambda query, key: False)
    loss_loop, grads_loop = loss_and_grads()
    torch.testing.assert_close(loss, loss_loop, atol=2e-2, rtol=2e-2)
    for name, grad in grads.items():  # bf16 rounding in other places: a relative error, not bitwise
        assert (grad - grads_loop[name]).norm() <= 0.03 * grads_loop[name].norm() + 1e-6, name

"""Our left-padded whole-conversation layout ↔ verl's prompt/response layout, through verl's own padding code."""

from __future__ import annotations

import pytest
import torch
from verl import DataProto

from SPA_agent.generators import build_generator
from SPA_agent.rollout.agent_proxy import LLMAgentProxy
from SPA_agent.trainer.local_backend import models as lm
from SPA_agent.trainer.verl_backend import layout as vl


@pytest.fixture(scope="module")
def rollout_batch(tiny_tokenizer, tiny_dir) -> DataProto:
    """A real rollout (random actions, tiny tokenizer): rows of different lengths, left padded."""
    from SPA_agent.config import compose

    cfg = compose("_2_sokoban", ["model=tiny", "generator=random"])
    proxy = LLMAgentProxy(cfg, build_generator(cfg.generator, str(tiny_dir), tiny_tokenizer), tiny_tokenizer)
    batch = proxy.rollout(val=False).batch
    assert len(set(batch.batch["attention_mask"].sum(-1).tolist())) > 1, "need rows of different lengths"
    return batch


def test_roll_rows_matches_torch_roll_per_row():
    x = torch.arange(12).view(3, 4)
    shifts = torch.tensor([0, -1, 2])
    expected = torch.stack([torch.roll(row, int(s)) for row, s in zip(x, shifts)])
    torch.testing.assert_close(vl.roll_rows(x, shifts), expected)


def test_known_vector_left_to_right_padding():
    batch = DataProto.from_dict(tensors={
        "input_ids": torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
        "response_mask": torch.tensor([[0.0, 0, 0, 1], [0, 1, 1, 0]]),  # row 0: token 7 sampled
    })
    out = vl.to_verl_layout(batch, ("response_mask",)).batch
    assert out["prompts"].tolist() == [[5], [1]]
    assert out["responses"].tolist() == [[6, 7, 0, 0], [2, 3, 4, 5]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert out["response_mask"].tolist() == [[0, 1, 0, 0], [0, 1, 1, 0]]
    assert out["position_ids"][0, :3].tolist() == [0, 1, 2]


def test_every_response_token_keeps_its_mask(rollout_batch):
    """Rolling is a bijection on real tokens: sampled tokens and their mask move together."""
    verl = vl.to_verl_layout(rollout_batch, ("response_mask", "loss_mask", "rm_scores")).batch
    ours = rollout_batch.batch
    for row in range(len(rollout_batch)):
        mask = ours["response_mask"][row].bool()
        assert ours["responses"][row][mask].tolist() == verl["responses"][row][verl["response_mask"][row].bool()].tolist()
        assert ours["rm_scores"][row].sum() == verl["rm_scores"][row].sum()
        real = int(ours["attention_mask"][row].sum())
        assert verl["responses"][row][: real - 1].tolist() == ours["input_ids"][row][-(real - 1):].tolist()


def _unpadded_log_probs(model, batch: DataProto) -> torch.Tensor:
    """What an engine worker returns: per real token t of each row, log p(token t+1 | ≤ t), as a nested tensor."""
    rows = []
    for ids, mask in zip(batch.batch["input_ids"], batch.batch["attention_mask"]):
        seq = ids[mask.bool()][None]
        logits = model(input_ids=seq).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None])[:, 0]
        rows.append(torch.cat([lp, torch.zeros(1)]))
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


@torch.no_grad()
def test_worker_outputs_come_back_aligned_with_the_local_backend(rollout_batch, tiny_model):
    """verl's no_padding_2_padding + our roll give the local backend's (B, T-1) log-probs on every real token."""
    data = vl.worker_input(rollout_batch, ("response_mask",), temperature=1.0)
    nested = _unpadded_log_probs(tiny_model, rollout_batch)
    ours = vl.worker_output(nested, data, rollout_batch.batch["attention_mask"])
    micro = {key: rollout_batch.batch[key] for key in lm.MODEL_INPUT_KEYS}
    local, _ = lm.token_log_probs(tiny_model, micro, temperature=1.0, with_entropy=False)
    attention = rollout_batch.batch["attention_mask"]
    both_real = (attention[:, :-1] * attention[:, 1:]).bool()
    assert ours.shape == local.shape
    torch.testing.assert_close(ours[both_real], local[both_real], atol=1e-4, rtol=1e-4)
    assert torch.all(ours[~both_real] == 0), "padding columns come back as zeros"


def test_worker_input_requires_response_mask(rollout_batch):
    with pytest.raises(ValueError, match="response_mask"):
        vl.worker_input(rollout_batch, ("loss_mask",))


def _mask(lengths: list[int]) -> torch.Tensor:
    width = max(lengths)
    return torch.tensor([[0] * (width - n) + [1] * n for n in lengths])


def test_balanced_order_evens_out_the_ranks_work():
    """Rows of very different lengths: verl's contiguous split of the batch order gives one rank all the long
    rows; in the balanced order each rank's chunk holds the same total work."""
    from verl.utils.seqlen_balancing import calculate_workload

    lengths = [100, 90, 80, 70, 10, 20, 30, 40]
    order = vl.balanced_order(_mask(lengths), dp_size=2)
    assert sorted(order.tolist()) == list(range(8))
    work = calculate_workload(torch.tensor(lengths))
    assert work[:4].sum() / work[4:].sum() > 3  # the batch's own order: one rank does 3x the other's work
    halves = work[order].view(2, 4).sum(-1)
    assert halves.max() / halves.min() < 1.01
    # each rank's rows: light ones at both ends (verl's layout of a partition)
    for chunk in order.view(2, 4):
        w = work[chunk]
        assert w[0] < w[1] and w[-1] < w[-2]


def test_balanced_order_is_verls_own_balance_batch():
    """The reference: verl's RayPPOTrainer._balance_batch reorders a batch in place; the same rows come first."""
    from types import SimpleNamespace

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    g = torch.Generator().manual_seed(3)
    for dp_size in (2, 4):
        lengths = torch.randint(5, 60, (16,), generator=g).tolist()
        batch = DataProto.from_dict(tensors={"attention_mask": _mask(lengths), "row": torch.arange(16)})
        trainer = SimpleNamespace(_get_dp_size=lambda group, role, dp=dp_size: dp, actor_rollout_wg=None)
        RayPPOTrainer._balance_batch(trainer, batch, metrics={})
        assert vl.balanced_order(_mask(lengths), dp_size).tolist() == batch.batch["row"].tolist()

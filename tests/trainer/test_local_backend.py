"""The `local` backend on the tiny model: log-probs, values, what the losses see, that updates update, save/load."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from SPA_agent.trainer.local_backend.backend import LocalBackend

#: the padded micro-batch path (fixed trajectory counts), the reference of the packed one (test_packing.py)
PADDED = ("use_dynamic_bsz=False", "actor_rollout_ref.model.use_remove_padding=False",
          "critic.model.use_remove_padding=False")


def _training_batch(backend: LocalBackend, batch, advantages=None, returns=None):
    """What the driver hands to the updates: response_mask := loss_mask, old log-probs, values, targets."""
    batch.batch["response_mask"] = batch.batch["loss_mask"]
    batch = batch.union(backend.compute_log_prob(batch)).union(backend.compute_values(batch))
    shape = batch.batch["loss_mask"].shape
    batch.batch["advantages"] = advantages if advantages is not None else torch.ones(shape)
    batch.batch["returns"] = returns if returns is not None else torch.ones(shape)
    return batch


def test_log_probs_are_temperature_scaled_and_independent_of_micro_batch(ppo_config, tiny_tokenizer, make_batch):
    cfg = ppo_config("_2_sokoban", *PADDED, "actor_rollout_ref.rollout.temperature=0.7",
                     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1")
    backend = LocalBackend(cfg, tiny_tokenizer)
    batch = make_batch()
    out = backend.compute_log_prob(batch).batch["old_log_probs"]
    t = batch.batch
    with torch.no_grad():
        logits = backend.actor.model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                                     position_ids=t["position_ids"]).logits[:, :-1] / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, 1:, None])[..., 0]
    real = t["attention_mask"][:, 1:].bool()
    torch.testing.assert_close(out[real], expected[real], rtol=1e-4, atol=1e-4)
    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 3
    torch.testing.assert_close(backend.compute_log_prob(batch).batch["old_log_probs"], out, rtol=1e-4, atol=1e-4)


def test_values_are_zero_outside_response_mask(ppo_config, tiny_tokenizer, make_batch):
    backend = LocalBackend(ppo_config(), tiny_tokenizer)
    batch = make_batch()
    values = backend.compute_values(batch).batch["values"]
    assert values.shape == batch.batch["loss_mask"].shape
    assert (values[batch.batch["response_mask"] == 0] == 0).all()
    assert (values[batch.batch["response_mask"] == 1] != 0).all()


def test_losses_only_see_the_loss_mask(ppo_config, tiny_tokenizer, make_batch):
    """Huge advantages/returns on masked positions change nothing: the losses are masked by loss_mask."""
    results = []
    for outside in (0.0, 1e6):
        backend = LocalBackend(ppo_config(), tiny_tokenizer)
        batch = make_batch()
        masked = batch.batch["loss_mask"] == 0
        targets = torch.where(masked, torch.full(masked.shape, outside), torch.linspace(-1, 1, masked.shape[-1]))
        batch = _training_batch(backend, batch, advantages=targets, returns=targets)
        metrics = {**backend.update_critic(batch), **backend.update_actor(batch)}
        results.append((metrics, [p.detach().clone() for p in backend.actor.model.parameters()]))
    (m0, p0), (m1, p1) = results
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss", "critic/grad_norm"):
        assert m0[key] == m1[key], key
    for a, b in zip(p0, p1):
        torch.testing.assert_close(a, b)


def test_update_does_not_depend_on_micro_batch_size(ppo_config, tiny_tokenizer, make_batch):
    metrics = []
    for micro in (1, 3):
        cfg = ppo_config("_2_sokoban", *PADDED, "ppo_mini_batch_size=3", f"micro_batch_size_per_gpu={micro}")
        backend = LocalBackend(cfg, tiny_tokenizer)
        batch = _training_batch(backend, make_batch(),
                                advantages=torch.randn(3, 11, generator=torch.Generator().manual_seed(0)))
        metrics.append({**backend.update_critic(batch), **backend.update_actor(batch)})
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert abs(metrics[0][key] - metrics[1][key]) <= 1e-4 * max(1.0, abs(metrics[0][key])), key


def test_update_does_not_depend_on_the_token_budget(ppo_config, tiny_tokenizer, make_batch):
    """Packed micro-batches by token budget (use_dynamic_bsz): a budget of one row a micro-batch and one of the whole
    mini-batch give the same update, so SmolLM2's doubled budgets (below) change the passes' time, not the losses."""
    results = []
    for budget in (16, 4096):
        cfg = ppo_config("_2_sokoban", "ppo_mini_batch_size=3", f"ppo_max_token_len_per_gpu={budget}",
                         f"log_prob_max_token_len_per_gpu={budget}")
        backend = LocalBackend(cfg, tiny_tokenizer)
        batch = _training_batch(backend, make_batch(),
                                advantages=torch.randn(3, 11, generator=torch.Generator().manual_seed(0)))
        plans = {len(backend._plan(batch, 1, True, budget))}
        metrics = {**backend.update_critic(batch), **backend.update_actor(batch)}
        results.append((plans, metrics, [p.detach().clone() for p in backend.actor.model.parameters()]))
    (plans0, m0, p0), (plans1, m1, p1) = results
    assert plans0 == {3} and plans1 == {1}  # one row a micro-batch, then all three in one
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert abs(m0[key] - m1[key]) <= 1e-4 * max(1.0, abs(m0[key])), key
    for a, b in zip(p0, p1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_smollm2_doubles_every_training_pass_token_budget():
    from SPA_agent.config import compose

    for model, (update, forward) in {"smollm2-135m": (32768, 65536), "tiny": (16384, 32768)}.items():
        cfg = compose("_2_sokoban", [f"model={model}"])
        assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == update
        assert cfg.critic.ppo_max_token_len_per_gpu == update
        assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == forward
        assert cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == forward
        assert cfg.critic.forward_max_token_len_per_gpu == forward


def test_update_raises_log_prob_of_high_advantage_actions(ppo_config, tiny_tokenizer, make_batch):
    cfg = ppo_config("_2_sokoban", "actor_rollout_ref.actor.optim.lr=1e-3", "ppo_mini_batch_size=3",
                     "actor_rollout_ref.actor.entropy_coeff=0")
    backend = LocalBackend(cfg, tiny_tokenizer)
    batch = make_batch()
    advantages = torch.zeros(3, 11)
    advantages[0], advantages[1] = 1.0, -1.0
    mask = batch.batch["loss_mask"].bool()

    def row_log_prob(row: int) -> float:
        return backend.compute_log_prob(batch).batch["old_log_probs"][row][mask[row]].mean().item()

    before = (row_log_prob(0), row_log_prob(1))
    for _ in range(3):
        step_batch = _training_batch(backend, make_batch(), advantages=advantages)
        metrics = backend.update_actor(step_batch)
        assert metrics["actor/grad_norm"] > 0
    after = (row_log_prob(0), row_log_prob(1))
    assert after[0] > before[0] + 0.1
    assert after[1] < before[1] - 0.1


def test_save_then_load_restores_weights_and_optimizer(ppo_config, tiny_tokenizer, tmp_path, make_batch):
    cfg = ppo_config("_2_sokoban", "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3")
    trained = LocalBackend(cfg, tiny_tokenizer)
    batch = _training_batch(trained, make_batch())
    trained.update_critic(batch)
    trained.update_actor(batch)
    trained.save(tmp_path / "ckpt")
    fresh = LocalBackend(cfg, tiny_tokenizer)
    fresh.load(tmp_path / "ckpt")
    for role in ("actor", "critic"):
        a, b = getattr(trained, role), getattr(fresh, role)
        for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
            torch.testing.assert_close(p, q, msg=f"{role} {name}")
        exp_avg = [s["exp_avg"] for s in a.optimizer.state_dict()["state"].values()]
        torch.testing.assert_close(exp_avg, [s["exp_avg"] for s in b.optimizer.state_dict()["state"].values()])
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "actor").config.model_type == "qwen2"
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "ckpt" / "critic")
    assert critic.config.num_labels == 1


def test_an_update_without_old_log_probs_takes_them_from_its_forward(ppo_config, tiny_tokenizer, make_batch):
    """actor.old_log_prob_from_update: one mini-batch of three rows in micro-batches of 1, 2 rows (a token budget
    that splits them unevenly), no old log-probs given: the update adds the ones `compute_log_prob` gives, token
    for token in the batch's row order, with their entropies, and moves the weights as the update that was given
    them (its PPO ratio, 1 up to rounding there, is exactly 1 here)."""
    results = []
    for given in (True, False):
        cfg = ppo_config("_2_sokoban", "ppo_mini_batch_size=3", "ppo_max_token_len_per_gpu=24",
                         "log_prob_max_token_len_per_gpu=4096")
        backend = LocalBackend(cfg, tiny_tokenizer)
        batch = _training_batch(backend, make_batch(),
                                advantages=torch.randn(3, 11, generator=torch.Generator().manual_seed(0)))
        expected = {key: batch.batch[key].clone() for key in ("old_log_probs", "entropys")}
        if not given:
            batch.pop(batch_keys=["old_log_probs", "entropys"])
        metrics = backend.update_actor(batch)
        results.append((metrics, [p.detach().clone() for p in backend.actor.model.parameters()]))
        real = batch.batch["attention_mask"][:, 1:].bool()
        for key, tensor in expected.items():
            torch.testing.assert_close(batch.batch[key][real], tensor[real], rtol=1e-5, atol=1e-6, msg=key)
    assert sorted(len(rows) for rows in backend._plan(batch, 1, True, 24)) == [1, 2]
    (m_given, p_given), (m_forward, p_forward) = results
    assert m_forward["actor/ppo_kl"] == 0.0
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert abs(m_given[key] - m_forward[key]) <= 1e-5 * max(1.0, abs(m_given[key])), key
    for a, b in zip(p_given, p_forward):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

"""PPO-ptx (actor.sft_aux_coef): the SFT loss of rows of the SFT data added to the actor's PPO loss, local backend."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from sft.packing import collate_padded, count_loss_tokens, token_loss_sum
from sft.spa_sft_dataset import SpaSftDataset
from SPA_agent.trainer.config_checks import check_config, check_sft_aux_files
from SPA_agent.trainer.local_backend import models as lm
from SPA_agent.trainer.local_backend.backend import LocalBackend
from SPA_agent.trainer.sft_aux import SftAuxData, draw_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sft"))
from sft_fixtures import synthetic_rows, write_rows  # noqa: E402

ACTOR = "actor_rollout_ref.actor"


@pytest.fixture
def sft_file(tmp_path):
    return write_rows(tmp_path / "wm_train.parquet", *synthetic_rows(12, seed=0))


def _aux(sft_file, coef, rows=4, *extra):
    return (f"{ACTOR}.sft_aux_coef={coef}", f"{ACTOR}.sft_aux_files=[{sft_file}]", f"{ACTOR}.sft_aux_rows={rows}",
            f"{ACTOR}.entropy_coeff=0", "ppo_mini_batch_size=3", *extra)


def _training_batch(backend, batch, advantages):
    batch.batch["response_mask"] = batch.batch["loss_mask"]
    batch = batch.union(backend.compute_log_prob(batch))
    batch.batch["advantages"] = advantages
    return batch


def _sft_loss(model, dataset, indices, pad_id) -> torch.Tensor:
    """The mean token cross-entropy of `indices`, computed directly (one padded batch)."""
    batch = collate_padded([dataset[i] for i in indices], pad_id)
    with lm.autocast(torch.device("cpu")):
        return token_loss_sum(model, batch) / count_loss_tokens(batch)


def test_coef_zero_is_exactly_the_current_update(ppo_config, tiny_tokenizer, make_batch, sft_file):
    params = []
    for overrides in ((), _aux(sft_file, 0.0)):
        cfg = ppo_config("_2_sokoban", f"{ACTOR}.entropy_coeff=0", "ppo_mini_batch_size=3", *overrides)
        backend = LocalBackend(cfg, tiny_tokenizer)
        assert backend.sft_aux is None
        advantages = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
        metrics = backend.update_actor(_training_batch(backend, make_batch(), advantages))
        assert "actor/sft_aux_loss" not in metrics
        params.append([p.detach().clone() for p in backend.actor.model.parameters()])
    for a, b in zip(*params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("packed", [True, False])
def test_with_zero_advantages_the_gradient_is_coef_times_the_sft_gradient(ppo_config, tiny_tokenizer, make_batch,
                                                                         sft_file, packed):
    coef = 0.5
    cfg = ppo_config("_2_sokoban", *_aux(sft_file, coef, 5),
                     f"actor_rollout_ref.model.use_remove_padding={packed}", f"use_dynamic_bsz={packed}",
                     "ppo_max_token_len_per_gpu=16")  # a budget below a row: the rows run in several micro-batches
    backend = LocalBackend(cfg, tiny_tokenizer)
    start = copy.deepcopy(backend.actor.model)
    grads = {}
    step = backend.actor.clip_and_step

    def capture():
        grads.update({n: p.grad.clone() for n, p in backend.actor.model.named_parameters() if p.grad is not None})
        return step()

    backend.actor.clip_and_step = capture
    metrics = backend.update_actor(_training_batch(backend, make_batch(), torch.zeros(3, 11)))
    aux = backend.sft_aux
    assert len(aux.micro_batches(0, 0)[0]) > 1
    indices = aux.indices(0, 0)
    loss = _sft_loss(start, aux.data, indices, aux.pad_id)
    loss.backward()
    assert metrics["actor/sft_aux_loss"] == pytest.approx(loss.item(), rel=1e-5)
    expected = {n: coef * p.grad for n, p in start.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_the_sft_loss_falls_more_with_the_term_than_without(ppo_config, tiny_tokenizer, make_batch, sft_file):
    losses = []
    for coef in (0.0, 1.0):
        cfg = ppo_config("_2_sokoban", *_aux(sft_file, coef), f"{ACTOR}.optim.lr=1e-3")
        backend = LocalBackend(cfg, tiny_tokenizer)
        data = SpaSftDataset(str(sft_file), tiny_tokenizer)
        rows = list(range(len(data)))
        advantages = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
        for seed in range(3):
            backend.update_actor(_training_batch(backend, make_batch(seed), advantages))
        with torch.no_grad():
            losses.append(_sft_loss(backend.actor.model, data, rows, tiny_tokenizer.eos_token_id).item())
    assert losses[1] < losses[0] - 0.1


def test_lora_actor_trains_its_adapters_on_the_sft_loss(ppo_config, tiny_tokenizer, make_batch, sft_file):
    cfg = ppo_config("_2_sokoban", *_aux(sft_file, 1.0), "actor_rollout_ref.model.lora_rank=2")
    backend = LocalBackend(cfg, tiny_tokenizer)
    before = {n: p.detach().clone() for n, p in backend.actor.model.named_parameters()}
    metrics = backend.update_actor(_training_batch(backend, make_batch(), torch.zeros(3, 11)))
    assert metrics["actor/sft_aux_loss"] > 0 and metrics["actor/grad_norm"] > 0
    changed = {n for n, p in backend.actor.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)


def test_the_rows_are_a_function_of_seed_update_and_mini_batch(tiny_tokenizer, sft_file):
    assert draw_rows(12, 5, 0, 3, 1) == draw_rows(12, 5, 0, 3, 1)
    assert len(set(draw_rows(12, 12, 0, 3, 1))) == 12  # no repeats within a data set's size
    assert len(draw_rows(12, 30, 0, 0, 0)) == 30
    assert draw_rows(12, 5, 0, 3, 1) not in (draw_rows(12, 5, 1, 3, 1), draw_rows(12, 5, 0, 4, 1),
                                             draw_rows(12, 5, 0, 3, 2))
    a, b = (SftAuxData(str(sft_file), tiny_tokenizer, 4, 7, True, 4096) for _ in range(2))
    assert a.indices(5, 0) == b.indices(5, 0)
    torch.testing.assert_close(a.micro_batches(5, 0), b.micro_batches(5, 0))


def test_a_resumed_backend_draws_the_rows_of_its_next_update(ppo_config, tiny_tokenizer, make_batch, sft_file, tmp_path):
    cfg = ppo_config("_2_sokoban", *_aux(sft_file, 1.0))
    trained = LocalBackend(cfg, tiny_tokenizer)
    trained.update_actor(_training_batch(trained, make_batch(), torch.zeros(3, 11)))
    trained.save(tmp_path / "ckpt")
    fresh = LocalBackend(cfg, tiny_tokenizer)
    fresh.load(tmp_path / "ckpt")
    assert fresh.actor.scheduler.last_epoch == trained.actor.scheduler.last_epoch == 1  # the next update's draw
    assert fresh.sft_aux.indices(1, 0) == trained.sft_aux.indices(1, 0) != trained.sft_aux.indices(0, 0)


@pytest.mark.parametrize(("overrides", "message"), [
    ((f"{ACTOR}.sft_aux_coef=-0.1",), "sft_aux_coef must be >= 0"),
    ((f"{ACTOR}.sft_aux_coef=abc",), "sft_aux_coef must be a number"),
    ((f"{ACTOR}.sft_aux_coef=0.1",), "needs the SFT data"),
    ((f"{ACTOR}.sft_aux_coef=0.1", f"{ACTOR}.sft_aux_files=[/nonexistent/wm_train.parquet]"), "does not exist"),
    ((f"{ACTOR}.sft_aux_rows=0",), "sft_aux_rows must be >= 1"),
    ((f"{ACTOR}.sft_aux_coef=0.1", "SFT", "trainer.backend=verl"), "trainer.backend=local only"),
])
def test_config_errors_are_one_line(ppo_config, sft_file, overrides, message):
    overrides = [f"{ACTOR}.sft_aux_files=[{sft_file}]" if o == "SFT" else o for o in overrides]
    cfg = ppo_config("_2_sokoban", *overrides)
    with pytest.raises(ValueError) as error:
        check_config(cfg)
        check_sft_aux_files(cfg)  # at a run's start (a pipeline's check comes before its data exist)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_default_config_is_off_and_checks(ppo_config, sft_file):
    cfg = ppo_config()
    assert cfg.actor_rollout_ref.actor.sft_aux_coef == 0
    check_config(cfg)
    check_config(ppo_config("_2_sokoban", *_aux(sft_file, 0.1), "ppo_mini_batch_size=2"))
    check_sft_aux_files(ppo_config("_2_sokoban", *_aux(sft_file, 0.1)))
    # a pipeline checks its PPO settings before its data stage has written the SFT data
    check_config(ppo_config("_2_sokoban", f"{ACTOR}.sft_aux_coef=0.1", f"{ACTOR}.sft_aux_files=[/later/wm_train.parquet]"))


@pytest.mark.slow
def test_a_resumed_run_reproduces_the_uninterrupted_run_with_the_term(ppo_config, tmp_path, sft_file):
    """PPO runs end to end with the term (actor/sft_aux_loss logged), and interrupted after step 1 and resumed, its
    step 2 (the SFT rows drawn included) and final actor equal an uninterrupted run's."""
    from transformers import AutoModelForCausalLM

    from SPA_agent.runs.metrics_logger import read_metrics
    from SPA_agent.trainer.main_ppo import run

    common = (f"{ACTOR}.sft_aux_coef=0.5", f"{ACTOR}.sft_aux_files=[{sft_file}]", f"{ACTOR}.sft_aux_rows=3",
              "trainer.save_freq=1", "trainer.test_freq=0", "trainer.diagnostics.mi_freq=0")
    straight = run(ppo_config("_2_sokoban", "trainer.total_training_steps=2", *common,
                              f"trainer.default_local_dir={tmp_path / 'straight'}"))
    resumed_dir = f"trainer.default_local_dir={tmp_path / 'resumed'}"
    run(ppo_config("_2_sokoban", "trainer.total_training_steps=1", *common, resumed_dir))
    resumed = run(ppo_config("_2_sokoban", "trainer.total_training_steps=2", *common, resumed_dir))
    step2 = [read_metrics(d / "metrics.jsonl")[-1] for d in (straight, resumed)]
    assert step2[0]["actor/sft_aux_loss"] > 0
    for key in ("actor/sft_aux_loss", "actor/pg_loss", "actor/grad_norm"):
        assert step2[0][key] == pytest.approx(step2[1][key], rel=1e-5, abs=1e-7), key
    actors = [AutoModelForCausalLM.from_pretrained(d / "global_step_2" / "actor") for d in (straight, resumed)]
    for (name, a), (_, b) in zip(actors[0].named_parameters(), actors[1].named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)

"""LoRA PPO on the tiny model: what trains, the reference, generation weights, checkpoints, evaluation, resume."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from SPA_agent.runs.metrics_logger import read_metrics
from SPA_agent.trainer.local_backend import lora
from SPA_agent.trainer.local_backend import models as lm
from SPA_agent.trainer.local_backend.backend import LocalBackend
from SPA_agent.trainer.main_ppo import run

#: LoRA on actor and critic, a learning rate that moves the adapters visibly in one step
LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8", "critic.model.lora_rank=4",
        "actor_rollout_ref.actor.optim.lr=1e-2", "critic.optim.lr=1e-2", "ppo_mini_batch_size=3")


def _is_trained(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".modules_to_save." in name


def _updated_backend(ppo_config, tiny_tokenizer, make_batch, *overrides):
    """A LoRA backend after one critic and one actor update on a rollout-shaped batch; its parameters before."""
    backend = LocalBackend(ppo_config("_2_sokoban", *LORA, *overrides), tiny_tokenizer)
    before = {role: {n: p.detach().clone() for n, p in t.model.named_parameters()}
              for role, t in backend._trainables().items()}
    batch = make_batch()
    batch.batch["response_mask"] = batch.batch["loss_mask"]
    batch = batch.union(backend.compute_log_prob(batch)).union(backend.compute_values(batch))
    batch.batch["advantages"] = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    batch.batch["returns"] = torch.ones(3, 11)
    backend.update_critic(batch)
    backend.update_actor(batch)
    return backend, before, batch


def _base_log_probs(tiny_dir, batch) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    with torch.no_grad():
        return lm.token_log_probs(model, batch.batch, temperature=1.0, with_entropy=False)[0]


def test_only_adapters_and_value_head_train_and_the_reference_stays_the_base_model(
        ppo_config, tiny_tokenizer, make_batch, tiny_dir):
    backend, before, batch = _updated_backend(ppo_config, tiny_tokenizer, make_batch,  # as in the paper's runs
                                              "actor_rollout_ref.model.enable_gradient_checkpointing=True",
                                              "critic.model.enable_gradient_checkpointing=True")
    assert backend.ref is None and backend.has_ref  # no second copy: the actor without adapters
    for role, trainable in backend._trainables().items():
        params = dict(trainable.model.named_parameters())
        trained = {n for n, p in params.items() if p.requires_grad}
        assert trained and all(_is_trained(n) for n in trained), role
        assert sum(len(g["params"]) for g in trainable.optimizer.param_groups) == len(trained), role
        changed = {n for n in params if not torch.equal(params[n], before[role][n])}
        assert changed <= trained, (role, changed - trained)  # base weights bit-identical
        assert any(".lora_B." in n for n in changed), role
    assert any(".score.modules_to_save." in n for n in trained)  # the critic's value head trains in full
    mask = batch.batch["attention_mask"].bool()
    real = mask[:, :-1] & mask[:, 1:]  # a real token predicted from a real one (packed passes skip padding)
    base = _base_log_probs(tiny_dir, batch)
    ref = backend.compute_ref_log_prob(batch).batch["ref_log_prob"]
    torch.testing.assert_close(ref[real], base[real], rtol=1e-5, atol=1e-6)
    actor = backend.compute_log_prob(batch).batch["old_log_probs"]
    assert (actor[real] - base[real]).abs().max() > 1e-3  # the adapters are active outside the reference pass


def test_merged_weights_match_peft_merge_and_feed_the_generation_copy(ppo_config, tiny_tokenizer, make_batch):
    backend, before, batch = _updated_backend(ppo_config, tiny_tokenizer, make_batch)
    for trainable in backend._trainables().values():
        merged = lora.merged_state_dict(trainable.model)
        expected = copy.deepcopy(trainable.model).merge_and_unload().state_dict()
        assert merged.keys() == expected.keys()
        for key in merged:
            torch.testing.assert_close(merged[key], expected[key], rtol=0, atol=0, msg=key)
    actor = backend.actor.model
    q_proj = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(lora.merged_state_dict(actor)[f"{q_proj}.weight"],
                           before["actor"][f"base_model.model.{q_proj}.base_layer.weight"])
    # what the GPU path does in bf16 (LocalBackend.generator), here in float32: a plain model, merged weights
    plain = lm.rollout_copy(actor, torch.float32)
    lm.copy_weights(plain, lora.generation_weights(actor))
    assert not lora.is_lora(plain) and plain.generation_config.eos_token_id == actor.generation_config.eos_token_id
    inputs = {k: batch.batch[k] for k in lm.MODEL_INPUT_KEYS}
    with torch.no_grad():
        torch.testing.assert_close(plain(**inputs).logits, actor.eval()(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_lora_ppo_runs_resumes_and_its_merged_checkpoint_evaluates(ppo_config, tmp_path, tiny_dir):
    """Two steps straight vs. one step then a resumed second: same losses, same adapters; the merged actor is
    base + adapter and `SPA_agent.evaluate` runs on it."""
    from SPA_agent.config import compose
    from SPA_agent.evaluation.evaluate import evaluate, prepare_eval_config

    common = (*LORA[:3], "trainer.save_freq=1", "trainer.test_freq=0", "ppo_mini_batch_size=2")
    straight = run(ppo_config("_2_sokoban", "trainer.total_training_steps=2", *common,
                              f"trainer.default_local_dir={tmp_path / 'straight'}"))
    resumed_dir = f"trainer.default_local_dir={tmp_path / 'resumed'}"
    run(ppo_config("_2_sokoban", "trainer.total_training_steps=1", *common, resumed_dir))
    resumed = run(ppo_config("_2_sokoban", "trainer.total_training_steps=2", *common, resumed_dir))
    records = [read_metrics(d / "metrics.jsonl") for d in (straight, resumed)]
    assert [r["step"] for r in records[1]] == [1, 2]
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "rollout/old_log_prob",
                "rollout/ref_log_prob"):
        assert math.isfinite(records[0][-1][key])
        assert records[0][-1][key] == pytest.approx(records[1][-1][key], rel=1e-5, abs=1e-7), key
    actors = [d / "global_step_2" / "actor" for d in (straight, resumed)]
    merged = [AutoModelForCausalLM.from_pretrained(a).state_dict() for a in actors]
    for key in merged[0]:
        torch.testing.assert_close(merged[0][key], merged[1][key], rtol=1e-5, atol=1e-6, msg=key)
    from_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir),
                                             actors[0] / lora.ADAPTER_DIR).merge_and_unload().state_dict()
    for key in merged[0]:
        torch.testing.assert_close(merged[0][key], from_adapter[key], rtol=1e-6, atol=1e-7, msg=key)
    assert (straight / "global_step_2" / "critic" / lora.ADAPTER_DIR / "adapter_model.safetensors").exists()
    cfg = compose("_2_sokoban", ["model=tiny", f"model_path={actors[0]}", "generator=hf", "++evaluation.n=2",
                                 "++evaluation.k=[1,2]", "++evaluation.num_puzzles=2", "agent_proxy.max_turn=2",
                                 "actor_rollout_ref.rollout.response_length=8",
                                 f"++evaluation.output_dir={tmp_path / 'eval'}"])
    result = evaluate(prepare_eval_config(cfg, "_2_sokoban"))
    assert result["complete"] and result["num_trajectories"] == 4
    assert result["metrics"]["SimpleSokoban"]["response_length"] > 0


def test_unknown_target_module_names_the_key(ppo_config, tiny_tokenizer):
    cfg = ppo_config("_2_sokoban", "actor_rollout_ref.model.lora_rank=2", "actor_rollout_ref.model.target_modules=[qproj]")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.target_modules .*qproj"):
        LocalBackend(cfg, tiny_tokenizer)

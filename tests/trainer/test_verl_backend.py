"""Backend selection, the verl runtime check, and verl's worker losses against the local backend on one batch.

The Ray/vLLM part of VerlBackend needs GPUs and is not run here (docs/scale_out.md lists the GPU checks); what runs
is everything the workers do to our batch on the way in and out: the layout mapping, the translated ActorConfig /
CriticConfig, and verl's own `ppo_loss` / `value_loss` (verl.workers.utils.losses) as its engine calls them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.losses import ppo_loss, value_loss

from SPA_agent.config import compose
from SPA_agent.generators import build_generator
from SPA_agent.rollout.agent_proxy import LLMAgentProxy
from SPA_agent.trainer.backend import build_backend
from SPA_agent.trainer.local_backend import backend as local_backend
from SPA_agent.trainer.local_backend import models as lm
from SPA_agent.trainer.verl_backend import config as verl_config
from SPA_agent.trainer.verl_backend import layout as verl_layout
from SPA_agent.trainer.verl_backend.backend import conversation_key, runtime_problems, update_meta


def test_unknown_backend_lists_the_valid_ones(tiny_tokenizer):
    cfg = compose("_2_sokoban", ["model=tiny", "trainer.backend=megatron"])
    with pytest.raises(ValueError, match=r"choose one of \['local', 'verl'\]"):
        build_backend(cfg, tiny_tokenizer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without GPUs")
def test_verl_backend_without_gpu_names_what_to_install(tiny_tokenizer):
    cfg = compose("_2_sokoban", ["model=tiny", "trainer.backend=verl"])
    with pytest.raises(ValueError, match=r"missing here: .*a CUDA GPU.*pip install 'spa-agent\[gpu\]'"):
        build_backend(cfg, tiny_tokenizer)


@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "critic"])
def test_update_meta_reads_every_key_of_both_roles(role):
    """The first verl PPO step on GPUs stopped at the critic update: `critic.shuffle` was missing from the config."""
    cfg = compose("_2_sokoban", ["actor_rollout_ref.actor.ppo_mini_batch_size=32", "critic.ppo_mini_batch_size=32"])
    role_cfg = cfg
    for key in role.split("."):
        role_cfg = role_cfg[key]
    assert update_meta(role_cfg, temperature=1.0, seed=7) == {
        "temperature": 1.0, "global_batch_size": 32, "mini_batch_size": 32, "epochs": 1, "seed": 7,
        "dataloader_kwargs": {"shuffle": False}}


def test_conversation_key_routes_a_trajectorys_turns_and_its_group_together():
    from SPA_agent.generators.base import Prompt

    system, start = {"role": "system", "content": "play"}, {"role": "user", "content": "#_P_#"}
    turn = lambda *later: Prompt(messages=[system, start, *later], prompt_ids=[1])
    first = conversation_key(turn())
    assert conversation_key(turn({"role": "assistant", "content": "Up"}, {"role": "user", "content": "#P__#"})) == first
    assert conversation_key(Prompt(messages=[system, {"role": "user", "content": "#P__#"}], prompt_ids=[1])) != first


def test_engine_wakes_once_per_rollout_and_reports_its_seconds():
    """The weight sync and engine resume run once before the first turn after training, the release once before
    the first training pass; their seconds come back once (issue 28: the phases they hide in)."""
    from SPA_agent.trainer.metrics import PhaseTimer
    from SPA_agent.trainer.verl_backend.backend import VerlBackend

    calls = []

    class Checkpoints:
        update_weights = staticmethod(lambda version: calls.append(("sync", version)))
        sleep_replicas = staticmethod(lambda: calls.append(("sleep",)))

    backend = object.__new__(VerlBackend)  # the engine bookkeeping only: no Ray workers
    backend.workers = type("Workers", (), {"checkpoints": Checkpoints})()
    backend._rollout_awake, backend._actor_updates, backend._timer = False, 3, PhaseTimer()
    backend._wake_rollout(), backend._wake_rollout(), backend._sleep_rollout(), backend._sleep_rollout()
    assert calls == [("sync", 3), ("sleep",)]
    assert set(backend.step_timings()) == {"timing_s/rollout_wake", "timing_s/rollout_sleep"}
    assert backend.step_timings() == {}


def test_vllm_requests_ask_for_the_final_token_ids_only(monkeypatch):
    import enum
    import sys
    import types

    from SPA_agent.trainer.verl_backend.backend import request_options

    class RequestOutputKind(enum.Enum):  # vllm.sampling_params's (vLLM is not installed on CPU machines)
        CUMULATIVE, DELTA, FINAL_ONLY = 0, 1, 2

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params",
                        types.SimpleNamespace(RequestOutputKind=RequestOutputKind))
    assert request_options("vllm") == {"output_kind": RequestOutputKind.FINAL_ONLY, "detokenize": False}
    assert request_options("sglang") == {}


def test_runtime_problems_lists_each_missing_piece():
    assert runtime_problems("vllm", lambda name: True, cuda_available=True) == []
    assert runtime_problems("vllm", lambda name: name != "vllm", cuda_available=True) == ["vllm"]
    assert runtime_problems("sglang", lambda name: False, cuda_available=False) == ["ray", "sglang", "a CUDA GPU"]


# ------------------------------------------------------------------------------------------------ losses


@pytest.fixture(scope="module")
def setup(tiny_tokenizer, tiny_dir):
    """A rollout batch with old log-probs, values, advantages and returns, plus the local backend that made them."""
    cfg = compose("_2_sokoban", ["model=tiny", "generator=random", "trainer.device=cpu"])
    torch.manual_seed(0)
    proxy = LLMAgentProxy(cfg, build_generator(cfg.generator, str(tiny_dir), tiny_tokenizer), tiny_tokenizer)
    batch = proxy.rollout(val=False).batch
    batch.batch["response_mask"] = batch.batch["loss_mask"].float()
    backend = local_backend.LocalBackend(cfg, tiny_tokenizer)
    batch = batch.union(backend.compute_log_prob(batch)).union(backend.compute_values(batch))
    mask = batch.batch["response_mask"]
    batch.batch["advantages"] = torch.randn(mask.shape) * mask
    batch.batch["returns"] = (batch.batch["values"] + torch.randn(mask.shape)) * mask
    batch.batch["old_log_probs"] = batch.batch["old_log_probs"] + 0.3 * torch.randn(mask.shape) * mask  # ratios ≠ 1
    return cfg, backend, batch


def _nested(per_row: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(per_row, layout=torch.jagged)


def _engine_outputs(model, batch, values: bool) -> dict[str, torch.Tensor]:
    """What verl's engine hands the loss: per real token t of each row, the output about token t+1 (nested)."""
    lps, ents, vals = [], [], []
    for ids, mask in zip(batch.batch["input_ids"], batch.batch["attention_mask"]):
        seq = ids[mask.bool()][None]
        out = model(input_ids=seq).logits[0].float()
        pad = torch.zeros(1)
        if values:
            vals.append(torch.cat([out[:-1, 0], pad]))
            continue
        logp = torch.log_softmax(out[:-1], -1)
        lps.append(torch.cat([logp.gather(-1, seq[0, 1:, None])[:, 0], pad]))
        ents.append(torch.cat([-(logp.exp() * logp).sum(-1), pad]))
    return {"values": _nested(vals)} if values else {"log_probs": _nested(lps), "entropy": _nested(ents)}


def _engine_meta(batch) -> dict:
    """The keys verl's FSDP engine and driver attach before calling the loss (one data-parallel rank)."""
    mask = batch.batch["response_mask"]
    return {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": len(batch)}


@torch.no_grad()
def test_verl_policy_loss_equals_the_local_backend_loss(setup):
    cfg, backend, batch = setup
    keys = ("response_mask", "old_log_probs", "advantages")
    data = verl_layout.worker_input(batch, keys, temperature=1.0, **_engine_meta(batch))
    actor_cfg = omega_conf_to_dataclass(verl_config.build_verl_config(cfg).actor_rollout_ref.actor)
    verl_loss, verl_metrics = ppo_loss(actor_cfg, _engine_outputs(backend.actor.model, batch, False), data)

    micro = {key: batch.batch[key] for key in (*lm.MODEL_INPUT_KEYS, *keys)}
    norm = local_backend._loss_normalisers(batch.batch["response_mask"])
    local_loss, local_metrics = backend._actor_micro_loss(micro, norm)
    torch.testing.assert_close(verl_loss, local_loss, atol=1e-5, rtol=1e-4)
    assert verl_metrics["actor/pg_loss"].values[0] == pytest.approx(local_metrics["actor/pg_loss"], abs=1e-5)
    assert verl_metrics["actor/entropy_loss"].values[0] == pytest.approx(local_metrics["actor/entropy"], abs=1e-5)


@torch.no_grad()
def test_verl_value_loss_equals_the_local_backend_loss(setup):
    cfg, backend, batch = setup
    from verl.trainer.ppo import core_algos

    keys = ("response_mask", "values", "returns")
    data = verl_layout.worker_input(batch, keys, temperature=1.0, **_engine_meta(batch))
    critic_cfg = omega_conf_to_dataclass(verl_config.build_verl_config(cfg).critic)
    verl_loss, _ = value_loss(critic_cfg, _engine_outputs(backend.critic.model, batch, True), data)

    micro = {key: batch.batch[key] for key in lm.MODEL_INPUT_KEYS}
    vpreds = lm.token_values(backend.critic.model, micro)
    local_loss, _ = core_algos.compute_value_loss(
        vpreds=vpreds, returns=batch.batch["returns"], values=batch.batch["values"],
        response_mask=batch.batch["response_mask"], cliprange_value=cfg.critic.cliprange_value,
        loss_agg_mode=cfg.critic.loss_agg_mode, **local_backend._loss_normalisers(batch.batch["response_mask"]))
    torch.testing.assert_close(verl_loss, local_loss, atol=1e-5, rtol=1e-4)


class _EchoGroup:
    """A verl worker group that records what it is sent and answers each pass with every token's own id as its
    per-token output, so where an output lands tells which row and token it came from."""

    def __init__(self):
        self.received = []

    def _echo(self, data, *keys):
        from verl.utils import tensordict_utils as tu

        self.received.append(data)
        ids = data["input_ids"]
        echo = torch.nested.nested_tensor_from_jagged(ids.values().float(), ids.offsets())
        return tu.get_tensordict(tensor_dict={key: echo for key in keys})

    def compute_log_prob(self, data):
        return self._echo(data, "log_probs", "entropy")

    def compute_ref_log_prob(self, data):
        return self._echo(data, "log_probs")

    def infer_batch(self, data):
        return type("Future", (), {"get": lambda _: self._echo(data, "values")})()

    def update_actor(self, data):
        from verl.utils import tensordict_utils as tu

        self.received.append(data)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {}})


def _echo_backend(n_gpus: int, tokenizer):
    """The driver side only: the echo groups stand in for Ray's (sglang: no vLLM request options to import)."""
    from SPA_agent.trainer.verl_backend.backend import VerlBackend

    cfg = compose("_2_sokoban", ["model=tiny", "trainer.backend=verl", f"trainer.n_gpus_per_node={n_gpus}",
                                 "verl_backend.rollout_name=sglang"])
    workers = type("Workers", (), {"actor": _EchoGroup(), "critic": _EchoGroup()})()
    return VerlBackend(cfg, tokenizer, workers=workers)


def test_two_ranks_get_balanced_rows_and_outputs_come_back_in_batch_order(tiny_tokenizer):
    """With two data-parallel ranks each pass sends the rows in verl's balanced order (verl_layout.balanced_order),
    and every per-token output comes back on its own row and token, as with one rank (no reordering)."""
    g = torch.Generator().manual_seed(0)
    lengths = [30, 28, 26, 24, 5, 6, 7, 8]  # the batch's order puts the long rows on rank 0
    width = max(lengths)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    ids = torch.randint(3, 800, (8, width), generator=g) * mask
    response_mask = (torch.rand(8, width - 1, generator=g) < 0.5).float() * mask[:, 1:]
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "response_mask": response_mask,
                                         "old_log_probs": torch.zeros(8, width - 1),
                                         "advantages": torch.zeros(8, width - 1)},
                                non_tensors={"seeds": np.arange(8)})  # the driver's batch carries such fields
    outputs = {}
    for n_gpus in (1, 2):
        backend = _echo_backend(n_gpus, tiny_tokenizer)
        outputs[n_gpus] = {**backend.compute_log_prob(batch).batch, **backend.compute_ref_log_prob(batch).batch,
                           **backend.compute_values(batch).batch}
        backend.update_actor(batch)
        sent = [data["input_ids"].offsets().diff().tolist() for data in backend.workers.actor.received]
        expected_order = verl_layout.balanced_order(mask, 2) if n_gpus == 2 else torch.arange(8)
        assert sent == [[lengths[row] for row in expected_order]] * 3  # old and ref log-probs, actor update
        assert backend.workers.critic.received[0]["input_ids"].offsets().diff().tolist() == sent[0]
        # each pass reports the driver's layout of its input and its worker-group call apart (issue 28)
        assert set(backend.step_timings()) == {f"timing_s/{phase}_{part}" for part in ("prepare", "call")
                                               for phase in ("old_log_prob", "ref", "values", "update_actor")}
    real = mask[:, 1:].bool()
    for key in ("old_log_probs", "entropys", "ref_log_prob"):
        # the output of token j+1's column is the echo of token j, the position it is predicted from
        torch.testing.assert_close(outputs[2][key][real], ids[:, :-1][real].float())
        torch.testing.assert_close(outputs[2][key], outputs[1][key])
    torch.testing.assert_close(outputs[2]["values"], ids[:, :-1].float() * response_mask)

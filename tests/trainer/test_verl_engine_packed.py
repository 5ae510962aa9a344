"""verl's FSDP engine packs micro-batches (`use_remove_padding`) through `packing.PACKED_ATTENTION` without
flash-attn: its log-probs, entropies, gradient and update equal those of padded micro-batches through SDPA. With
verl's fused head (`use_fused_kernels`, the log-probs and entropies computed from the hidden states in chunks) they
equal those of the plain head.

The engine (`FSDPEngineWithLMHead`, built from the typed configs of the project's verl config as verl's
`ActorRolloutRefWorker.init_model` / `TrainingWorker` build them) runs in a child process on the CPU: one gloo rank,
verl's platform replaced by a CPU one (verl 0.9.1 ships cuda/npu/rocm platforms only), and FSDP2 in place of the
configured FSDP1, which refuses to run without an accelerator ("FSDP needs a non-CPU accelerator device"). The child
keeps the platform, the process group and verl's patches (`verl_patches.apply`, as every Ray worker runs it) out of
the test process. The remove-padding code under test (`prepare_model_inputs` / `prepare_model_outputs`) is the same
for both FSDP versions.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
#: real tokens of the three left-padded rows, and the padded width
LENGTHS = (7, 11, 5)
WIDTH = 12
ATOL = 1e-4


def _engines(directory: Path) -> dict:
    """This file as the child process (below), run once for both tests beside the other tests (tests/conftest.py,
    `background`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return {"args": [sys.executable, __file__, str(directory / "result.json")], "cwd": REPO, "env": env, "timeout": 240}


@pytest.fixture
def engine_results(background_run) -> dict:
    """The child process's results: three engines (padded, packed, packed with verl's fused head) on one batch."""
    (result,), directory = background_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads((directory / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.background(command=_engines)
def test_verl_fsdp_engine_packs_through_the_per_sequence_attention(engine_results):
    r = engine_results

    # the packed engine is the project's: remove padding, our attention; the reference pads through SDPA
    assert r["packed"]["engine"] == r["padded"]["engine"] == "FSDPEngineWithLMHead"
    assert (r["packed"]["attention"], r["packed"]["use_remove_padding"]) == ("spa_packed_sdpa", True)
    assert (r["padded"]["attention"], r["padded"]["use_remove_padding"]) == ("sdpa", False)
    # the packed forwards (log-probs and training step) ran as one row split into the three trajectories
    assert r["packed"]["segments"] == r["packed"]["train_segments"] == list(LENGTHS)
    assert r["padded"]["segments"] is None and r["padded"]["train_segments"] is None

    mask = torch.tensor(r["response_mask"], dtype=torch.float32)
    assert mask.sum(dim=-1).tolist() == [n - 1 for n in LENGTHS]
    for key in ("log_probs", "entropy", "log_probs_after_update"):
        packed, padded = (torch.tensor(r[run][key]) * mask for run in ("packed", "padded"))
        assert torch.allclose(packed, padded, atol=ATOL, rtol=0), (key, (packed - padded).abs().max())
    # a real model, and a real update: log-probs are not uniform, and the step moved them the same way
    log_probs = torch.tensor(r["packed"]["log_probs"])[mask.bool()]
    assert log_probs.max() - log_probs.min() > 0.1
    moved = (torch.tensor(r["packed"]["log_probs_after_update"]) - torch.tensor(r["packed"]["log_probs"])) * mask
    assert moved.abs().max() > 10 * ATOL
    grad_norms = [r[run]["grad_norm"] for run in ("packed", "padded")]
    assert grad_norms[0] > 0 and grad_norms[0] == pytest.approx(grad_norms[1], rel=1e-4)
    assert r["packed"]["pg_loss"] == pytest.approx(r["padded"]["pg_loss"], abs=ATOL)


@pytest.mark.slow
@pytest.mark.background(command=_engines)
def test_verls_fused_head_on_packed_micro_batches_equals_the_plain_head(engine_results):
    """`actor_rollout_ref.model.use_fused_kernels` (verl's log-probs and entropies from the hidden states in
    chunks, no (tokens, vocabulary) logits; torch backend here) on the same packed micro-batches: same numbers."""
    r = engine_results
    assert r["fused"]["use_fused_kernels"] and not r["packed"]["use_fused_kernels"]
    assert r["fused"]["segments"] == r["fused"]["train_segments"] == list(LENGTHS)
    mask = torch.tensor(r["response_mask"], dtype=torch.float32)
    for key in ("log_probs", "entropy", "log_probs_after_update"):
        fused, plain = (torch.tensor(r[run][key]) * mask for run in ("fused", "packed"))
        assert torch.allclose(fused, plain, atol=ATOL, rtol=0), (key, (fused - plain).abs().max())
    assert r["fused"]["grad_norm"] == pytest.approx(r["packed"]["grad_norm"], rel=1e-4)


# ------------------------------------------------------------------------------------------------ the child process


def _child(out: Path) -> None:
    from functools import partial

    from verl_cpu import start_cpu_rank

    start_cpu_rank()

    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    from SPA_agent.config import compose
    from SPA_agent.trainer import packing
    from SPA_agent.trainer.verl_backend import layout as vl
    from SPA_agent.trainer.verl_backend import patches as verl_patches
    from SPA_agent.trainer.verl_backend.config import build_verl_config

    verl_patches.apply()
    cfg = compose("_2_sokoban", ["model=tiny", "trainer.backend=verl"])
    verl_cfg = build_verl_config(cfg).actor_rollout_ref
    assert verl_cfg.model.use_remove_padding and verl_cfg.model.override_config.attn_implementation == packing.PACKED_ATTENTION
    actor_cfg = OmegaConf.to_container(verl_cfg.actor)
    # CPU only: FSDP2 (FSDP1 needs an accelerator) and float32 compute (the config's mixed precision is bf16)
    actor_cfg["strategy"] = actor_cfg["fsdp_config"]["strategy"] = "fsdp2"
    actor_cfg["fsdp_config"]["mixed_precision"] = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}

    def engine(packed: bool, fused: bool = False):
        model = OmegaConf.to_container(verl_cfg.model)
        if not packed:
            model["use_remove_padding"] = False
            model["override_config"]["attn_implementation"] = "sdpa"
        model["use_fused_kernels"] = fused  # verl's fused head (torch backend): log-probs without (T, V) logits
        model_config = omega_conf_to_dataclass(OmegaConf.create(model))
        actor = omega_conf_to_dataclass(OmegaConf.create(actor_cfg))
        actor.model_config = model_config
        config = TrainingWorkerConfig(model_type="language_model", model_config=model_config,
                                      engine_config=actor.engine, optimizer_config=actor.optim,
                                      checkpoint_config=actor.checkpoint)
        e = config.engine_config  # as ActorRolloutRefWorker.init_model, then TrainingWorker.__init__
        e.use_dynamic_bsz = verl_cfg.actor.use_dynamic_bsz
        e.infer_max_token_len_per_gpu = verl_cfg.rollout.log_prob_max_token_len_per_gpu
        e.infer_micro_batch_size_per_gpu = verl_cfg.rollout.log_prob_micro_batch_size_per_gpu
        e.max_token_len_per_gpu = verl_cfg.actor.ppo_max_token_len_per_gpu
        e.micro_batch_size_per_gpu = verl_cfg.actor.ppo_micro_batch_size_per_gpu
        e.use_remove_padding = model_config.get("use_remove_padding", False)
        e.use_fused_kernels = model_config.get("use_fused_kernels", False)
        model_config.model_type = config.model_type
        built = EngineRegistry.new(model_type=config.model_type, backend=e.strategy, model_config=model_config,
                                   engine_config=e, optimizer_config=config.optimizer_config,
                                   checkpoint_config=config.checkpoint_config)
        built.initialize()
        return built, actor

    def engine_keys(built, training: bool) -> dict:
        """What TrainingWorker.infer_batch / train_batch add to the batch."""
        mc, ec = built.model_config, built.engine_config
        return dict(use_remove_padding=mc.get("use_remove_padding", False), use_dynamic_bsz=ec.use_dynamic_bsz,
                    max_token_len_per_gpu=ec.max_token_len_per_gpu if training else ec.infer_max_token_len_per_gpu,
                    micro_batch_size_per_gpu=ec.micro_batch_size_per_gpu if training else ec.infer_micro_batch_size_per_gpu,
                    use_fused_kernels=ec.use_fused_kernels)

    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(len(LENGTHS), WIDTH, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        mask[row, WIDTH - n:] = 1
    input_ids = torch.randint(3, 400, (len(LENGTHS), WIDTH), generator=g) * mask
    response_mask = mask[:, 1:] * mask[:, :-1]  # every prediction of a real token from a real token
    rollout = DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask, "response_mask": response_mask})
    advantages = torch.randn(len(LENGTHS), WIDTH - 1, generator=g) * response_mask

    def forward(built) -> tuple[torch.Tensor, torch.Tensor]:
        """VerlBackend.compute_log_prob on this engine: log-probs and entropies, (B, T-1) in our layout."""
        data = vl.worker_input(rollout, ("response_mask",), temperature=1.0, calculate_entropy=True, compute_loss=False)
        tu.assign_non_tensor(data, **engine_keys(built, training=False))
        with built.eval_mode():
            output = built.infer_batch(data, loss_function=None)["model_output"]
        return tuple(vl.worker_output(output[key], data, mask).float() for key in ("log_probs", "entropy"))

    def train(built, actor, old_log_probs) -> dict:
        """VerlBackend.update_actor on this engine: one PPO mini-batch of the three rows."""
        batch = DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask,
                                             "response_mask": response_mask, "old_log_probs": old_log_probs,
                                             "advantages": advantages})
        data = vl.worker_input(batch, ("response_mask", "old_log_probs", "advantages"), calculate_entropy=True,
                               compute_loss=True, distillation_use_topk=False, distillation_only=False,
                               temperature=1.0, global_batch_size=len(LENGTHS))
        tu.assign_non_tensor(data, **engine_keys(built, training=True))
        with built.train_mode():
            return built.train_batch(data, loss_function=partial(ppo_loss, config=actor))["metrics"]

    results, reference = {}, None
    for name, packed, fused in (("padded", False, False), ("packed", True, False), ("fused", True, True)):
        built, actor = engine(packed, fused)
        packing._last_segments = (None, None)
        log_probs, entropy = forward(built)
        segments = packing._last_segments[1]
        if reference is None:
            reference = log_probs  # both engines' update starts from the same old log-probs
        packing._last_segments = (None, None)
        metrics = train(built, actor, reference)
        train_segments = packing._last_segments[1]
        after, _ = forward(built)
        results[name] = {
            "engine": type(built).__name__, "attention": built.module.config._attn_implementation,
            "use_remove_padding": bool(built.use_remove_padding), "segments": segments,
            "use_fused_kernels": bool(built.engine_config.use_fused_kernels),
            "train_segments": train_segments, "log_probs": log_probs.tolist(), "entropy": entropy.tolist(),
            "log_probs_after_update": after.tolist(), "grad_norm": float(metrics["grad_norm"]),
            "pg_loss": float(metrics["actor/pg_loss"].aggregate()),
        }
    results["response_mask"] = response_mask.tolist()
    out.write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _child(Path(sys.argv[1]))

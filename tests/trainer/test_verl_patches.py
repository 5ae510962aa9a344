"""The verl fixes applied in every Ray worker: the critic's value model loads without flash-attn (issue 16); log-probs
in chunks, packed micro-batches through the per-sequence attention, SDPA without cuDNN; the worker calls timed on request
(issue 28)."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from SPA_agent.config import compose
from SPA_agent.trainer.packing import PACKED_ATTENTION
from SPA_agent.trainer.verl_backend import backend as verl_backend
from SPA_agent.trainer.verl_backend import config as verl_config
from SPA_agent.trainer.verl_backend import patches as verl_patches


@pytest.fixture
def patched_verl(monkeypatch):
    """verl with `apply()` run in this process, put back as it was afterwards."""
    import verl.utils.model as verl_model
    import verl.utils.torch_functional as verl_functional
    from verl.workers.engine.fsdp import transformer_impl

    monkeypatch.setattr(verl_model, "load_valuehead_model", verl_model.load_valuehead_model)
    for module in (verl_functional, transformer_impl):
        monkeypatch.setattr(module, "logprobs_from_logits", module.logprobs_from_logits)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    verl_patches.apply()
    yield
    torch.backends.cuda.enable_cudnn_sdp(cudnn)


@pytest.mark.parametrize("attention", ["sdpa", PACKED_ATTENTION])
def test_value_model_loads_with_the_configs_attention(tiny_dir, patched_verl, attention):
    import verl.utils.model as verl_model

    config = AutoConfig.from_pretrained(tiny_dir, attn_implementation=attention)
    config.num_labels = 1  # as verl's FSDP engine sets it for a value model
    model = verl_model.load_valuehead_model(str(tiny_dir), torch.float32, config, False)
    assert type(model).__name__ == "Qwen2ForTokenClassification"
    assert model.config._attn_implementation == attention and model.score.out_features == 1


def test_workers_pack_through_the_per_sequence_attention_without_cudnn(tiny_dir, patched_verl):
    # what verl's FSDP engine builds for the actor and reference: the causal LM named by the config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation=PACKED_ATTENTION)
    assert model.config._attn_implementation == PACKED_ATTENTION
    assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("all_gpus_visible", [True, False])
def test_every_ray_worker_runs_the_patch_and_sees_the_gpus_as_configured(all_gpus_visible):
    cfg = compose("_2_sokoban", ["model=tiny", "trainer.backend=verl", f"verl_backend.all_gpus_visible={all_gpus_visible}"])
    env = verl_backend.ray_runtime_env(verl_config.build_verl_config(cfg), cfg.verl_backend.all_gpus_visible, True,
                                       model_runner="auto", cpu_threads=1)
    module, function = env["worker_process_setup_hook"].rsplit(".", 1)
    assert getattr(importlib.import_module(module), function) is verl_patches.apply
    assert "TOKENIZERS_PARALLELISM" in env["env_vars"]  # verl's own runtime environment is kept
    # one GPU visible per worker made NCCL stop with "Duplicate GPU detected" on 2× H200 (issue 16)
    assert (env["env_vars"].get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") == "1") is all_gpus_visible


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37,), (3, 29)])
def test_chunked_logprobs_equal_verls_row_loop_in_value_and_gradient(monkeypatch, dtype, shape):
    # issue 28: verl's fallback without flash-attn loops over the (tokens, vocab) rows one kernel at a time
    from verl.utils.torch_functional import logprobs_from_logits_v2

    monkeypatch.setattr(verl_patches, "LOGPROB_CHUNK_ROWS", 8)  # several chunks and a ragged last one
    torch.manual_seed(0)
    logits = (3 * torch.randn(*shape, 50)).to(dtype)
    labels = torch.randint(0, 50, shape)
    ours_in, theirs_in = logits.clone().float().requires_grad_(), logits.clone().float().requires_grad_()
    ours = verl_patches.logprobs_from_logits(ours_in.to(dtype), labels)
    theirs = logprobs_from_logits_v2(theirs_in, labels)  # verl's float32 path, the reference
    assert ours.shape == labels.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-4)
    weights = torch.randn(shape)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=0, atol=tolerance)


def test_the_patch_replaces_verls_log_prob_function_where_its_engine_reads_it(patched_verl):
    import verl.utils.torch_functional as verl_functional
    from verl.workers.engine.fsdp import transformer_impl

    assert verl_functional.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE is False  # no flash-attn on this machine
    assert transformer_impl.logprobs_from_logits is verl_patches.logprobs_from_logits
    assert verl_functional.logprobs_from_logits is verl_patches.logprobs_from_logits


def test_timed_worker_calls_print_their_seconds_and_keep_verls_dispatch(capsys):
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers import engine_workers

    for class_name, names in verl_patches.TIMED_CALLS.items():  # the methods exist and verl registered them
        for name in names:
            assert hasattr(getattr(getattr(engine_workers, class_name), name), MAGIC_ATTR)

    def step(x):
        return x + 1

    async def sync(x):
        return x * 2

    for function in (step, sync):
        setattr(function, MAGIC_ATTR, {"blocking": False})
    timed_step, timed_sync = verl_patches.timed_call(step, "W.step"), verl_patches.timed_call(sync, "W.sync")
    assert timed_step(1) == 2 and asyncio.run(timed_sync(3)) == 6
    assert inspect.iscoroutinefunction(timed_sync) and not inspect.iscoroutinefunction(timed_step)
    assert getattr(timed_step, MAGIC_ATTR) == getattr(timed_sync, MAGIC_ATTR) == {"blocking": False}
    printed = capsys.readouterr().out.splitlines()
    fields = [line.split() for line in printed]
    assert [f[:3] for f in fields] == [["[spa", "worker", "seconds]"]] * 2 and [f[3] for f in fields] == ["W.step", "W.sync"]
    for wall, thread_cpu, gc_full in (f[4:] for f in fields):
        assert float(wall) >= 0 and thread_cpu.startswith("thread_cpu=") and gc_full.startswith("gc_full=")
        assert 0 <= float(gc_full.split("=")[1]) <= float(wall)


def test_a_timed_call_counts_the_full_collections_and_the_cpu_of_its_thread(capsys):
    import gc

    def collects_and_spins():
        gc.collect()
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass

    verl_patches.timed_call(collects_and_spins, "W.busy")()
    wall, thread_cpu, gc_full = capsys.readouterr().out.split()[4:]
    assert float(thread_cpu.split("=")[1]) >= 0.05 and float(gc_full.split("=")[1]) > 0
    assert float(thread_cpu.split("=")[1]) <= float(wall) + 0.01


def test_the_named_call_prints_its_operator_table_once_after_warm_up(capsys):
    def step(x):
        return torch.ones(64, 64) @ torch.ones(64, 64) + x

    timed = verl_patches.timed_call(step, "W.step", profile=True)
    for call in range(1, verl_patches.PROFILED_CALL + 2):
        timed(call)
        tables = capsys.readouterr().out.count("[spa worker profile] W.step")
        assert tables == (call == verl_patches.PROFILED_CALL)


#: one Ray cluster with the backend's runtime environment (setup hook included) and `worker_cpu_threads` null; a
#: worker of it, and one started with the environment variables that the setting 1 adds; prints their torch
#: threads and this process's (torch's default here)
WORKER_THREADS = """
import json, os, sys
import ray, torch
from SPA_agent.config import compose
from SPA_agent.trainer.verl_backend import backend as verl_backend
from SPA_agent.trainer.verl_backend import config as verl_config

def runtime_env(setting):
    cfg = compose("_2_sokoban", ["model=tiny", "trainer.backend=verl", f"verl_backend.worker_cpu_threads={setting}"])
    env = verl_backend.ray_runtime_env(verl_config.build_verl_config(cfg), False, False, model_runner="auto",
                                       cpu_threads=cfg.verl_backend.worker_cpu_threads)
    env["env_vars"]["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env

ray.init(num_cpus=2, runtime_env=runtime_env("null"), log_to_driver=False, include_dashboard=False)
threads = ray.remote(lambda: torch.get_num_threads())
print(json.dumps({"null": ray.get(threads.remote()),
                  "1": ray.get(threads.options(runtime_env={"env_vars": runtime_env("1")["env_vars"]}).remote()),
                  "default": torch.get_num_threads()}))
ray.shutdown()
"""


def _worker_threads(directory: Path) -> dict:
    """WORKER_THREADS in a child process that runs beside the other tests (tests/conftest.py, `background`)."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    return {"args": [sys.executable, "-c", WORKER_THREADS], "env": env, "timeout": 300}


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="torch's default is one thread on one core")
@pytest.mark.background(command=_worker_threads)
def test_ray_workers_start_torch_with_the_configured_threads(background_run):
    # the setup hook imports torch before Ray sets OMP_NUM_THREADS=1 (at a worker's first task): with null, torch
    # keeps its default pool of a thread per core in every worker, as it did on the GPU hosts (issue 28)
    (result,), _ = background_run
    assert result.returncode == 0, result.stderr[-4000:]
    threads = json.loads(result.stdout.strip().splitlines()[-1])
    assert threads["default"] > 1
    assert threads == {"null": threads["default"], "1": 1, "default": threads["default"]}

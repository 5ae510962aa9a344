"""The local and the verl backend update the policy alike: the same PPO steps on the same batch move it the same.

From the tiny model's weights, each backend takes three PPO steps on one synthetic batch (two mini-batches of two
trajectories, two epochs, one trajectory per micro-batch), recomputing the batch's log-probs before each step. The
verl backend drives verl's real actor worker in a child process: one gloo rank, FSDP2 in float32 (verl_cpu). After
every step the two backends' log-probs of the batch agree to float32 precision, and each step reports the same loss,
gradient norm, entropy and update KL.

The learning-parity runs on GPUs (docs/scale_out.md, "Same learning on either backend") differ in their samples
(vLLM against the local sampler) and run in bf16; this test shows that the update itself does not differ.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest

from SPA_agent.tiny import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl")


def _update_both(model_dir: str) -> list[dict]:
    """Per step: the largest log-prob difference between the backends before the step, each backend's mean
    log-prob shift from the start, and each backend's update metrics."""
    import train_passes
    from transformers import AutoTokenizer
    from verl_cpu import CPU_SETTINGS

    from SPA_agent.trainer.local_backend.backend import LocalBackend

    settings = ["actor_rollout_ref.actor.use_ref=False", "ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
                "actor_rollout_ref.actor.ppo_epochs=2", "use_dynamic_bsz=False"]
    configs = {}
    for backend, extra in (("local", []), ("verl", ["verl_backend.rollout_name=sglang", *CPU_SETTINGS])):
        sets = [arg for setting in settings + extra for arg in ("--set", setting)]
        args = train_passes.parse_args(["--model", model_dir, "--backend", backend, "--preset", "tiny",
                                        "--trajectories", "4", "--tokens", "40", *sets])
        configs[backend] = train_passes.compose_run(args, world=1, cuda=False)
    configs["verl"].trainer.balance_batch = False  # keep the batch's row order, as the local backend does
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    backends = {"local": LocalBackend(configs["local"], tokenizer),
                "verl": train_passes.verl_backend(configs["verl"], tokenizer)}
    batch = train_passes.synthetic_batch(4, 40, 0.05, 0.58, len(tokenizer), tokenizer.pad_token_id, seed=0)
    mask = batch.batch["response_mask"].bool()
    start, steps = None, []
    for _ in range(STEPS + 1):
        log_probs = {name: b.compute_log_prob(copy.deepcopy(batch)) for name, b in backends.items()}
        local, verl = (log_probs[name].batch["old_log_probs"][mask] for name in ("local", "verl"))
        start = local.clone() if start is None else start
        step = {"max_diff": float((local - verl).abs().max()),
                "shift": {"local": float((local - start).abs().mean()), "verl": float((verl - start).abs().mean())}}
        if len(steps) < STEPS:
            step["metrics"] = {name: {k: float(v) for k, v in b.update_actor(
                copy.deepcopy(batch).union(log_probs[name])).items() if k in METRICS}
                for name, b in backends.items()}
        steps.append(step)
    return steps


def _both_backends(directory: Path) -> dict:
    """This file as the child process (below), run beside the other tests (tests/conftest.py, `background`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return {"args": [sys.executable, __file__, str(tiny_model_dir())], "cwd": ROOT, "env": env, "timeout": 300}


@pytest.mark.slow
@pytest.mark.background(command=_both_backends)
def test_the_same_steps_move_the_policy_the_same_on_both_backends(background_run):
    (result,), _ = background_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    steps = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(steps) == STEPS + 1
    for step in steps:
        assert step["max_diff"] < 1e-5, step  # the same log-probs before every step and after the last
        assert step["shift"]["verl"] == pytest.approx(step["shift"]["local"], rel=1e-4, abs=1e-6)
    assert steps[-1]["shift"]["local"] > 1e-3  # the steps did move the policy
    for step in steps[:-1]:
        local, verl = step["metrics"]["local"], step["metrics"]["verl"]
        assert set(local) == set(verl) == set(METRICS)
        for key in METRICS:
            assert verl[key] == pytest.approx(local[key], rel=1e-4, abs=1e-7), (key, local, verl)
    assert all(step["metrics"]["local"]["actor/ppo_kl"] != 0 for step in steps[:-1])  # the second epoch ran


if __name__ == "__main__":  # the child: this process as a one-rank CPU "GPU" group, then both backends
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(Path(__file__).parent)]
    from verl_cpu import start_cpu_rank

    start_cpu_rank()
    print(json.dumps(_update_both(sys.argv[1])))

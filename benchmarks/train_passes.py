"""The training passes of one PPO step on either backend, without generation: old log-probs, reference
log-probs, values, critic update and actor update of a synthetic kept batch, timed pass by pass (issue 28).

    python benchmarks/train_passes.py --model DIR --backend local [--set KEY=VALUE ...]
    torchrun --nproc_per_node 2 benchmarks/train_passes.py --model DIR --backend verl [--set KEY=VALUE ...]
    python benchmarks/train_passes.py --model DIR --backend verl --ray 2 [--ray-async] [--set KEY=VALUE ...]

The batch is shaped like the one the paper's step trains (`_2_sokoban`: 64 kept trajectories of about 2,540 tokens,
58% of them sampled; random ids, left padded as the agent proxy pads). The passes are the backends' own methods:
`LocalBackend` on one device, or `VerlBackend` driving verl's real workers (`ActorRolloutRefWorker` for the actor
and for the reference, `TrainingWorker` for the critic, `verl_backend/patches.py` applied) built in this process,
one torchrun rank per GPU, each rank holding the share of the batch that verl's dispatch gives it (after VerlBackend's
balanced reordering, `trainer.balance_batch`). No Ray and no
rollout engine: a setting's effect on the passes takes about a minute to measure, not a full run's four-minute
start. `--set` overrides our config (Hydra syntax), verl's own keys through `verl_backend.verl_config`, e.g.
`--set +verl_backend.verl_config.actor_rollout_ref.actor.strategy=fsdp2`.

`--ray N` runs the N ranks as Ray actors, one GPU each, in the Ray job environment of the verl backend
(`verl_backend.ray_runtime_env`) instead of torchrun's processes; `--ray-async` makes them async actors, whose
methods Ray runs outside the main thread, as it runs those of verl's fused worker; `--setup-hook` keeps the
backend's worker setup hook, which a full run's workers run when they start. Still no rollout engine: set
against torchrun and a full run, it tells whether a pass is slower in a Ray worker as such or beside vLLM.
`--rank-setup MODULE:FUNCTION` calls that function in each rank first (the CPU tests' one-rank gloo group).

Prints one JSON line per repeat (seconds per pass, the slowest rank's; then rank 0's thread CPU seconds per pass) and the median of the repeats after the
first (which includes warm-up); --out appends them to a JSON-lines file with the settings. --profile PASS prints
that pass's 25 costliest operators by GPU time in the last repeat (rank 0; "Self CUDA time total" against the pass's
seconds tells how long the GPU sat idle).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.distributed.elastic.utils.distributed import get_free_port
from verl import DataProto

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from SPA_agent.config import compose  # noqa: E402
from SPA_agent.trainer.gc_heap import freeze_long_lived_objects  # noqa: E402
from SPA_agent.trainer.metrics import operator_table  # noqa: E402
from SPA_agent.trainer.verl_backend import layout as verl_layout  # noqa: E402

#: the passes in the order a PPO step runs them
PASSES = ("old_log_prob", "ref", "values", "update_critic", "update_actor")


def synthetic_batch(trajectories: int, mean_tokens: int, spread: float, response_share: float, vocab: int,
                    pad_id: int, seed: int) -> DataProto:
    """Left-padded rows of random ids, lengths uniform within ±`spread` of `mean_tokens`; the last
    `response_share` of each row's tokens are its sampled ones; advantages and returns are random."""
    g = torch.Generator().manual_seed(seed)
    low, high = int(mean_tokens * (1 - spread)), int(mean_tokens * (1 + spread))
    lengths = torch.randint(low, high + 1, (trajectories,), generator=g)
    width = int(lengths.max())
    attention_mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    input_ids = torch.randint(3, vocab, (trajectories, width), generator=g) * attention_mask + pad_id * (1 - attention_mask)
    first_response = width - (lengths.float() * response_share).long()
    response_mask = (torch.arange(1, width)[None, :] >= first_response[:, None]).float()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.randn(trajectories, width - 1, generator=g) * response_mask
    returns = torch.randn(trajectories, width - 1, generator=g) * response_mask
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": attention_mask,
                                        "position_ids": position_ids, "response_mask": response_mask,
                                        "advantages": advantages, "returns": returns})


class InProcess:
    """A verl worker called in this process as its Ray worker group is called by VerlBackend: methods verl
    registers as non-blocking return an object whose `get()` is the result; `routes` send a method to another
    worker (the reference's log-probs to the reference worker)."""

    def __init__(self, worker, routes: dict | None = None):
        self.worker, self.routes = worker, routes or {}

    def __getattr__(self, name):
        from verl.single_controller.base.decorator import MAGIC_ATTR

        method = getattr(self.routes.get(name, self.worker), name)
        if getattr(method, MAGIC_ATTR, {}).get("blocking", True):
            return method
        return lambda *args, **kwargs: SimpleNamespace(get=lambda: method(*args, **kwargs))


def verl_backend(cfg, tokenizer):
    """VerlBackend over verl's workers built here (this rank's share of each model)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from SPA_agent.trainer.verl_backend import patches as verl_patches
    from SPA_agent.trainer.verl_backend.backend import VerlBackend, critic_setup, ray_runtime_env
    from SPA_agent.trainer.verl_backend.config import build_verl_config

    verl_cfg = build_verl_config(cfg)
    worker_env = ray_runtime_env(verl_cfg, False, cfg.trainer.gc_freeze, model_runner="auto",
                                 cpu_threads=cfg.verl_backend.worker_cpu_threads)["env_vars"]
    for key, value in worker_env.items():  # a Ray worker's
        os.environ.setdefault(key, str(value))
    verl_patches.apply()
    workers = {}
    for role in ("actor", "ref") if cfg.actor_rollout_ref.actor.use_ref else ("actor",):
        workers[role] = ActorRolloutRefWorker(copy.deepcopy(verl_cfg.actor_rollout_ref), role=role)
        workers[role].init_model()
    critic_config, critic_loss = critic_setup(verl_cfg)
    critic = TrainingWorker(critic_config)
    critic.reset()
    critic.set_loss_fn(critic_loss)
    ref = {"compute_ref_log_prob": workers["ref"]} if "ref" in workers else {}
    group = SimpleNamespace(actor=InProcess(workers["actor"], ref), critic=InProcess(critic))
    return VerlBackend(cfg, tokenizer, workers=group)


class PassesRank:
    """One rank of the benchmark in a Ray actor: the environment torchrun would give it, then the rank's run."""

    def run(self, rank_env: dict[str, str], args: argparse.Namespace) -> dict:
        import ray

        gpus = ray.get_gpu_ids()  # every GPU is visible (verl_backend.all_gpus_visible): use the one Ray gave
        os.environ.update(rank_env, LOCAL_RANK=str(gpus[0]) if gpus else "0")
        return run_rank(args)


class AsyncPassesRank(PassesRank):
    """The same in an async actor (one async method suffices): Ray then runs `run` outside the main thread, as
    it runs the methods of verl's fused worker, an async actor for its weight sync."""

    async def ready(self) -> bool:
        return True


def in_ray(args: argparse.Namespace) -> dict:
    """The ranks as Ray actors in the verl backend's Ray job environment; without `--setup-hook`, without its
    worker setup hook (each rank applies `verl_backend/patches.py` itself, after `--rank-setup`); returns rank 0's
    result."""
    import ray

    from SPA_agent.trainer.verl_backend.backend import local_cluster_env, ray_runtime_env
    from SPA_agent.trainer.verl_backend.config import build_verl_config

    cuda = torch.cuda.is_available()
    cfg = compose_run(args, args.ray, cuda)
    cfg.verl_backend.all_gpus_visible = cuda  # each rank picks the GPU Ray gave it (PassesRank)
    for key, value in local_cluster_env(cfg.verl_backend).items():  # as start_ray: the cluster inherits them
        os.environ.setdefault(key, value)
    runtime = ray_runtime_env(build_verl_config(cfg), cuda, cfg.trainer.gc_freeze, model_runner="auto",
                              cpu_threads=cfg.verl_backend.worker_cpu_threads)
    if not args.setup_hook:
        runtime.pop("worker_process_setup_hook")
    # this process's import path (the benchmarks and any --rank-setup module) for the actors
    runtime["env_vars"]["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    ray.init(runtime_env=runtime, log_to_driver=False)
    actor = ray.remote(num_gpus=1 if cuda else 0)(AsyncPassesRank if args.ray_async else PassesRank)
    port = get_free_port()
    try:
        ranks = [actor.remote() for _ in range(args.ray)]
        return ray.get([
            handle.run.remote({"RANK": str(rank), "WORLD_SIZE": str(args.ray),
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, args)
            for rank, handle in enumerate(ranks)])[0]
    finally:
        ray.shutdown()


def one_step(backend, batch: DataProto, sync, profile: str | None = None) -> dict[str, float]:
    """Seconds of each pass of one PPO step on `batch` (values and old log-probs from the backend itself), their
    total, then each pass's `<pass>_thread_cpu`: the CPU seconds of this process's main thread in it (near the pass's
    seconds when launching its kernels bounds it). The pass named `profile` also prints its kernel table (its time
    then includes the profiler's overhead)."""
    seconds, thread_cpu = {}, {}

    def timed(name, fn, *args):
        sync()
        start, thread_start = time.perf_counter(), time.thread_time()
        with operator_table(name) if name == profile else nullcontext():
            out = fn(*args)
            sync()
        seconds[name] = time.perf_counter() - start
        thread_cpu[f"{name}_thread_cpu"] = time.thread_time() - thread_start
        return out

    batch = batch.union(timed("old_log_prob", backend.compute_log_prob, batch))
    if backend.has_ref:
        batch = batch.union(timed("ref", backend.compute_ref_log_prob, batch))
    batch = batch.union(timed("values", backend.compute_values, batch))
    timed("update_critic", backend.update_critic, batch)
    timed("update_actor", backend.update_actor, batch)
    seconds["total"] = sum(seconds.values())
    return {**seconds, **thread_cpu}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face model directory (benchmarks/random_model.py)")
    parser.add_argument("--backend", choices=("local", "verl"), required=True)
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="model preset (config/model/) of the run's settings")
    parser.add_argument("--repeats", type=int, default=4, help="steps to time; the first is warm-up")
    parser.add_argument("--trajectories", type=int, default=64, help="kept trajectories of the step (all ranks)")
    parser.add_argument("--tokens", type=int, default=2540, help="mean tokens per trajectory")
    parser.add_argument("--spread", type=float, default=0.05, help="lengths uniform within ± this share")
    parser.add_argument("--response-share", type=float, default=0.58, help="share of a row's tokens trained")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override of our config (repeatable)")
    parser.add_argument("--profile", choices=PASSES, help="print this pass's kernel table in the last repeat (rank 0)")
    parser.add_argument("--release-cache", action="store_true",
                        help="before each step, empty the CUDA allocator's cache as verl's weight sync does after a "
                             "rollout (then expandable segments), so the passes allocate as in a full run")
    parser.add_argument("--label", default="", help="name of this setting in the output")
    parser.add_argument("--out", type=Path, help="JSON-lines file to append the results to")
    parser.add_argument("--ray", type=int, metavar="N", help="run N ranks as Ray actors (verl backend), not torchrun's")
    parser.add_argument("--ray-async", action="store_true", help="with --ray: async actors, as verl's fused worker")
    parser.add_argument("--setup-hook", action="store_true",
                        help="with --ray: keep the backend's worker setup hook, which runs (and imports torch) when "
                             "each worker process starts, as in a full run")
    parser.add_argument("--rank-setup", metavar="MODULE:FUNCTION", help="called in each rank before anything else")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    world = args.ray or int(os.environ.get("WORLD_SIZE", 1))
    if args.backend == "local" and world > 1:
        parser.error("the local backend runs one process: start it with python, not torchrun or --ray")
    if args.ray is not None and (args.ray < 1 or "WORLD_SIZE" in os.environ):
        parser.error("--ray takes a number of ranks ≥ 1 and starts them itself: run it with python, not torchrun")
    for flag, given in (("--ray-async", args.ray_async), ("--setup-hook", args.setup_hook)):
        if given and args.ray is None:
            parser.error(f"{flag} needs --ray N")
    if args.trajectories % world:
        parser.error(f"--trajectories ({args.trajectories}) must be a multiple of the {world} ranks")
    return args


def compose_run(args: argparse.Namespace, world: int, cuda: bool):
    """The run's config: the paper's Sokoban setting with this benchmark's model, ranks and overrides."""
    return compose("_2_sokoban", [f"model={args.preset}", f"model_path={args.model}", f"trainer.backend={args.backend}",
                                  f"trainer.n_gpus_per_node={world}", f"trainer.device={'cuda' if cuda else 'cpu'}",
                                  f"ppo_mini_batch_size={args.trajectories}", *args.overrides])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.ray:
        args.model = str(Path(args.model).resolve())  # the actors run elsewhere
        result = in_ray(args)
        for line in result["lines"]:
            print(line, flush=True)
    else:
        result = run_rank(args)
    if args.out and result["summary"] is not None:
        with args.out.open("a") as f:
            f.write(json.dumps(result["summary"]) + "\n")


def run_rank(args: argparse.Namespace) -> dict:
    """This rank's part of the benchmark: {"lines": what rank 0 printed, "summary": rank 0's summary} (other
    ranks: nothing)."""
    from transformers import AutoTokenizer

    if args.rank_setup:
        module, function = args.rank_setup.split(":")
        getattr(importlib.import_module(module), function)()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    cfg = compose_run(args, world, cuda)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    batch = synthetic_batch(args.trajectories, args.tokens, args.spread, args.response_share, len(tokenizer),
                            tokenizer.pad_token_id, seed=0)
    tokens = int(batch.batch["attention_mask"].sum())
    if args.backend == "verl" and cfg.trainer.balance_batch:
        # VerlBackend's own reordering for the ranks (trainer.balance_batch), done here on the whole batch: each
        # rank's backend below sees its share only
        batch = batch.select_idxs(verl_layout.balanced_order(batch.batch["attention_mask"], world))
        cfg.trainer.balance_batch = False
    share = args.trajectories // world
    batch = batch[rank * share:(rank + 1) * share]  # verl's dispatch: contiguous chunks, one per data-parallel rank
    if args.backend == "local":
        from SPA_agent.trainer.local_backend.backend import LocalBackend

        backend = LocalBackend(cfg, tokenizer)
    else:
        backend = verl_backend(cfg, tokenizer)
    if cfg.trainer.gc_freeze:  # as main_ppo does once the models are built
        freeze_long_lived_objects()
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if distributed:
            torch.distributed.barrier()

    def release_cache():
        """What verl's weight sync leaves behind after each rollout (`ActorRolloutRefWorker.update_weights`): the
        allocator's cache emptied (for the engine's KV cache), then expandable segments on."""
        from verl.utils.device import set_expandable_segments

        set_expandable_segments(False)
        torch.cuda.empty_cache()
        set_expandable_segments(True)

    steps, lines, summary = [], [], None

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for repeat in range(args.repeats):
        if args.release_cache and cuda:
            release_cache()
        profile = args.profile if repeat == args.repeats - 1 and rank == 0 else None
        seconds = one_step(backend, copy.deepcopy(batch), sync, profile)  # a step adds its outputs to the batch
        steps.append(seconds)
        if rank == 0:
            emit(json.dumps({"label": args.label, "repeat": repeat, **{k: round(v, 4) for k, v in seconds.items()}}))
    if rank == 0:
        steady = steps[1:] or steps
        median = {key: statistics.median(s[key] for s in steady) for key in steady[0]}
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        summary = {"label": args.label, "backend": args.backend, "gpus": world, "median_s": median,
                   "steps": steps, "peak_gib": round(peak, 2), "overrides": args.overrides,
                   "release_cache": args.release_cache,
                   "ranks": "ray async actors" if args.ray_async else "ray actors" if args.ray else "processes",
                   "device": torch.cuda.get_device_name() if cuda else "cpu", "niceness": os.nice(0),
                   "torch_threads": torch.get_num_threads(),
                   "tokens": tokens}
        emit("median of repeats 2+: " + "  ".join(f"{k} {v:.3f}" for k, v in median.items()))
    if distributed:
        torch.distributed.destroy_process_group()
    return {"lines": lines, "summary": summary}


if __name__ == "__main__":
    main()

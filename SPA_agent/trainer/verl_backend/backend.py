"""`verl` backend: verl's Ray/FSDP engine workers and its vLLM/SGLang server rollout behind our WorkerGroup protocol.

Placement (spec §10.4): one Ray resource pool of `trainer.n_gpus_per_node × trainer.nnodes` GPUs holding one
colocated worker per GPU: verl's `ActorRolloutRefWorker` (FSDP actor, frozen reference when `use_ref` — with a
LoRA actor, the actor with its adapters disabled — and the rollout engine sharing the GPU: the hybrid engine) and
a `TrainingWorker` value model (the critic). The rollout engine runs verl's server mode; our driver's
LLMAgentProxy keeps the multi-turn loop and sends each turn's prompt ids through verl's `LLMServerClient` (token
in, token out), so prompts, parsing, masks and rewards are the local backend's code. Log-probs, values and both
PPO updates run inside verl's workers with verl's losses (`verl.workers.utils.losses.ppo_loss` / `value_loss`,
i.e. `core_algos`).

The engine's memory is handed back and forth as verl's trainer does: the first `generate` after training syncs
the FSDP actor's weights into the engine and wakes it (`CheckpointEngineManager.update_weights`); the first
training call after generating puts the engine to sleep. Batches move between the layouts with `layout.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig
from verl import DataProto
from verl.utils import tensordict_utils as tu

from SPA_agent.generators.base import FINISH_LENGTH, FINISH_STOP, Generation, Prompt
from SPA_agent.trainer.gc_heap import WORKER_GC_FREEZE_ENV
from SPA_agent.trainer.metrics import PhaseTimer
from SPA_agent.trainer.verl_backend import layout as vl
from SPA_agent.trainer.verl_backend.config import (
    INSTALL_HINT,
    build_verl_config,
    check_verl_config,
    model_runner_env,
)

#: metric names of verl's workers → ours (as the local backend logs them)
METRIC_NAMES = {"actor/entropy_loss": "actor/entropy", "actor/mfu": "perf/mfu/actor", "critic/mfu": "perf/mfu/critic"}


def runtime_problems(rollout_name: str, installed, cuda_available: bool) -> list[str]:
    """What this machine lacks for trainer.backend=verl: missing packages (`installed(name)` is False) and GPUs."""
    problems = [name for name in ("ray", rollout_name) if not installed(name)]
    return problems + ([] if cuda_available else ["a CUDA GPU"])


def check_runtime(cfg: DictConfig) -> None:
    """One clear ValueError naming everything trainer.backend=verl needs and does not find here."""
    problems = runtime_problems(cfg.verl_backend.rollout_name,
                                lambda name: importlib.util.find_spec(name) is not None, torch.cuda.is_available())
    if problems:
        raise ValueError(
            f"trainer.backend=verl needs ray, {cfg.verl_backend.rollout_name} and CUDA GPUs; missing here: "
            f"{', '.join(problems)}. On a GPU machine: {INSTALL_HINT} (offline hosts: scripts/offline_wheelhouse.sh); "
            "or train on one device with trainer.backend=local"
        )


#: run in every Ray worker process before it imports verl's workers (Ray's `worker_process_setup_hook`)
WORKER_SETUP_HOOK = "SPA_agent.trainer.verl_backend.patches.apply"


#: with it set, Ray does not restrict each worker's CUDA_VISIBLE_DEVICES (verl_backend.all_gpus_visible)
ALL_GPUS_VISIBLE_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


#: torch's CPU threads in a process (read when torch loads, so it must be in a Ray worker's environment at start)
CPU_THREADS_ENV = "OMP_NUM_THREADS"


def ray_runtime_env(verl_cfg: DictConfig, all_gpus_visible: bool, gc_freeze: bool, *, model_runner: str,
                    cpu_threads: int | None) -> dict:
    """verl's PPO runtime environment for the Ray job, plus our worker setup hook (patches.py); with
    `all_gpus_visible`, every GPU visible to every worker (each selects its own by Ray's id); with `gc_freeze`
    (trainer.gc_freeze), workers that freeze their start-up objects once their models are built (`gc_heap`);
    `model_runner` (verl_backend.vllm_model_runner) picks the rollout engines' model runner (`model_runner_env`);
    `cpu_threads` (verl_backend.worker_cpu_threads), unless None, is each worker's OMP_NUM_THREADS from its start.

    Why set it: Ray sets OMP_NUM_THREADS=1 only when a worker runs its first task, after the setup hook has
    imported torch, which by then has sized its thread pool to every core of the machine."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    env = get_ppo_ray_runtime_env(verl_cfg)
    env["env_vars"] = {**env.get("env_vars", {}), WORKER_GC_FREEZE_ENV: "1" if gc_freeze else "0",
                       **({ALL_GPUS_VISIBLE_ENV: "1"} if all_gpus_visible else {}), **model_runner_env(model_runner),
                       **({CPU_THREADS_ENV: str(cpu_threads)} if cpu_threads is not None else {})}
    return {**env, "worker_process_setup_hook": WORKER_SETUP_HOOK}


def set_driver_cpu_threads(backend_cfg: DictConfig) -> None:
    """torch's CPU threads in this (the driver's) process: `verl_backend.driver_cpu_threads` unless None. With the
    verl backend the driver only lays out batches, filters them and computes advantages on the CPU, beside the
    workers and the rollout engines of the same machine: torch's pool of a thread per core made that slower there
    (benchmarks/RESULTS.md, "One torch thread in the driver")."""
    if backend_cfg.driver_cpu_threads is not None:
        torch.set_num_threads(int(backend_cfg.driver_cpu_threads))


#: Ray's setting of its workers' scheduling priority (`nice`), read by a cluster when it starts
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"


def local_cluster_env(backend_cfg: DictConfig) -> dict[str, str]:
    """Environment variables that a Ray cluster started by this process (`ray.init` without a running cluster)
    inherits; a running cluster keeps those it started with. `verl_backend.worker_niceness`: Ray starts its
    workers at nice 15 by default, below every ordinary process of the machine."""
    env = {ALL_GPUS_VISIBLE_ENV: "1"} if backend_cfg.all_gpus_visible else {}
    if backend_cfg.worker_niceness is not None:
        env[RAY_WORKER_NICENESS_ENV] = str(int(backend_cfg.worker_niceness))
    return env


def start_ray(backend_cfg: DictConfig, verl_cfg: DictConfig, gc_freeze: bool) -> None:
    """Join the Ray cluster at `verl_backend.ray_address` (None: the one `ray start` made on this machine, else a
    new local one, with `local_cluster_env` unless this process's environment sets those variables itself)."""
    import os

    import ray

    if not ray.is_initialized():
        for key, value in local_cluster_env(backend_cfg).items():
            os.environ.setdefault(key, value)
        ray.init(address=backend_cfg.ray_address,
                 runtime_env=ray_runtime_env(verl_cfg, bool(backend_cfg.all_gpus_visible), gc_freeze,
                                             model_runner=backend_cfg.vllm_model_runner,
                                             cpu_threads=backend_cfg.worker_cpu_threads))


class VerlWorkers:
    """The Ray worker groups and the rollout servers, started as verl's RayPPOTrainer.init_workers starts them."""

    def __init__(self, verl_cfg: DictConfig, has_ref: bool):
        import ray
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager
        from verl.single_controller.ray.base import create_colocated_worker_cls
        from verl.trainer.ppo.utils import Role
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
        from verl.workers.rollout.llm_server import LLMServerManager

        actor_role = Role.ActorRolloutRef if has_ref else Role.ActorRollout
        trainer = verl_cfg.trainer
        pools = ResourcePoolManager(resource_pool_spec={"global_pool": [trainer.n_gpus_per_node] * trainer.nnodes},
                                    mapping={actor_role: "global_pool", Role.Critic: "global_pool"})
        pools.create_resource_pool()
        pool = pools.get_resource_pool(actor_role)
        critic_config, critic_loss = critic_setup(verl_cfg)
        classes = {
            str(actor_role): RayClassWithInitArgs(cls=ray.remote(ActorRolloutRefWorker),
                                                  config=verl_cfg.actor_rollout_ref, role=str(actor_role)),
            str(Role.Critic): RayClassWithInitArgs(cls=ray.remote(TrainingWorker), config=critic_config),
        }
        group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls(class_dict=classes),
                               device_name="cuda")
        groups = group.spawn(prefix_set=classes.keys())
        self.critic = groups[str(Role.Critic)]
        self.critic.reset()
        self.critic.set_loss_fn(critic_loss)
        self.actor = groups[str(actor_role)]
        self.actor.init_model()  # last, so the rollout engine sees what memory is left
        servers = LLMServerManager.create(config=verl_cfg, worker_group=self.actor, rollout_resource_pool=pool)
        self.client = servers.get_client()
        engine_cfg = omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.rollout.checkpoint_engine)
        self.checkpoints = CheckpointEngineManager(config=engine_cfg, actor_wg=self.actor,
                                                   replicas=servers.get_replicas())
        self.checkpoints.sleep_replicas()


def critic_setup(verl_cfg: DictConfig):
    """What a critic worker is started with: its TrainingWorkerConfig and its loss (verl's `value_loss`)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import value_loss

    critic_cfg = omega_conf_to_dataclass(verl_cfg.critic)
    return _critic_worker_config(critic_cfg), partial(value_loss, config=critic_cfg)


def _critic_worker_config(critic_cfg):
    """verl's TrainingWorkerConfig of a value model, as RayPPOTrainer.init_workers builds it, with the critic's own
    micro-batching (RayPPOTrainer leaves the engine's default: token budgets, whatever `critic.use_dynamic_bsz`)."""
    from verl.workers.config import TrainingWorkerConfig

    engine = critic_cfg.engine
    engine.use_dynamic_bsz = critic_cfg.use_dynamic_bsz
    engine.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    engine.max_token_len_per_gpu = critic_cfg.ppo_max_token_len_per_gpu
    engine.micro_batch_size_per_gpu = engine.infer_micro_batch_size_per_gpu = critic_cfg.ppo_micro_batch_size_per_gpu
    return TrainingWorkerConfig(model_type="value_model", model_config=critic_cfg.model, engine_config=engine,
                                optimizer_config=critic_cfg.optim, checkpoint_config=critic_cfg.checkpoint)


def _metrics(raw: dict, prefix: str) -> dict[str, float]:
    """verl worker metrics (lists per micro-batch) → one float each, named as the local backend names them."""
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    reduced = reduce_metrics(rename_dict(dict(raw), prefix))
    return {METRIC_NAMES.get(key, key): float(value) for key, value in reduced.items()}


class VerlBackend:
    """The worker group of `trainer.backend=verl` (see backend.WorkerGroup for the contract)."""

    def __init__(self, cfg: DictConfig, tokenizer, workers=None):
        """`workers`: groups with VerlWorkers' `actor` and `critic` to drive instead of starting Ray and verl's
        workers (benchmarks/train_passes.py runs them in its own processes, without a rollout engine)."""
        if workers is None:
            check_runtime(cfg)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.verl_cfg = build_verl_config(cfg)
        check_verl_config(cfg, self.verl_cfg)
        self.has_ref = bool(cfg.actor_rollout_ref.actor.use_ref)
        # with a LoRA actor the reference is the actor with its adapters disabled (verl's `ref_in_actor`)
        self.ref_in_actor = cfg.actor_rollout_ref.model.lora_rank > 0
        self.temperature = float(cfg.actor_rollout_ref.rollout.temperature)
        self.sampling = self._sampling_params()
        if workers is None:
            set_driver_cpu_threads(cfg.verl_backend)
            start_ray(cfg.verl_backend, self.verl_cfg, bool(cfg.trainer.gc_freeze))
            workers = VerlWorkers(self.verl_cfg, self.has_ref and not self.ref_in_actor)
        self.workers = workers
        self._rollout_awake = False
        self._actor_updates = 0
        self._timer = PhaseTimer()

    # ---------------------------------------------------------------- generation

    def _sampling_params(self) -> dict:
        from SPA_agent.generators.vllm import model_stop_ids

        rollout = self.cfg.actor_rollout_ref.rollout
        self.stop_ids = model_stop_ids(self.verl_cfg.actor_rollout_ref.model.path, self.tokenizer)
        return {"temperature": float(rollout.temperature), "top_p": float(rollout.top_p), "top_k": int(rollout.top_k),
                "max_tokens": int(rollout.response_length), "stop_token_ids": list(self.stop_ids),
                **request_options(self.cfg.verl_backend.rollout_name)}

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        """One turn for every prompt, on verl's rollout servers with the actor's current weights."""
        self._wake_rollout()
        return asyncio.run(self._generate_all(prompts))

    async def _generate_all(self, prompts: list[Prompt]) -> list[Generation]:
        return list(await asyncio.gather(*(self._generate_one(p) for p in prompts)))

    async def _generate_one(self, prompt: Prompt) -> Generation:
        output = await self.workers.client.generate(conversation_key(prompt), prompt_ids=list(prompt.prompt_ids),
                                                    sampling_params=dict(self.sampling))
        if output.stop_reason == "aborted":
            raise RuntimeError("the rollout server aborted a request (engine put to sleep mid-generation)")
        ids = list(output.token_ids)
        finished = bool(ids) and ids[-1] in self.stop_ids
        return Generation(text=self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids,
                          finish_reason=FINISH_STOP if finished else FINISH_LENGTH)

    def _wake_rollout(self) -> None:
        """Sync the FSDP actor's weights into the engine and resume it (verl's naive checkpoint engine)."""
        if not self._rollout_awake:
            with self._timer("rollout_wake"):  # inside the driver's `gen`
                self.workers.checkpoints.update_weights(self._actor_updates)
            self._rollout_awake = True

    def _sleep_rollout(self) -> None:
        """Free the engine's weights and KV cache for the training passes."""
        if self._rollout_awake:
            with self._timer("rollout_sleep"):  # inside the first training pass after `gen`
                self.workers.checkpoints.sleep_replicas()
            self._rollout_awake = False

    def step_timings(self) -> dict[str, float]:
        """Weight sync and engine resume (`rollout_wake`), engine release (`rollout_sleep`), and for each pass
        the driver's layout of its input (`<phase>_prepare`) and its worker-group call (`<phase>_call`: dispatch
        to the workers, their work, collection); the rest of the phase is the driver's layout of the output."""
        timings, self._timer = self._timer.metrics(), PhaseTimer()
        return timings

    # ---------------------------------------------------------------- inference passes

    def _token_output(self, output, data, batch: DataProto, key: str) -> torch.Tensor:
        return vl.worker_output(tu.get(output, key), data, batch.batch["attention_mask"]).float()

    def _in_dispatch_order(self, batch: DataProto) -> tuple[DataProto, torch.Tensor | None]:
        """The batch reordered so that each data-parallel rank gets about the same work (`trainer.balance_batch`,
        as verl's trainer balances its batch), and the index that puts the rows of an output back in order."""
        dp_size = self.cfg.trainer.n_gpus_per_node * self.cfg.trainer.nnodes
        if not self.cfg.trainer.balance_batch or dp_size == 1:
            return batch, None
        order = vl.balanced_order(batch.batch["attention_mask"], dp_size)
        return batch.select_idxs(order), order.argsort()

    def _per_token_outputs(self, phase: str, group_call, batch: DataProto, keys: dict[str, str],
                           token_keys: tuple[str, ...], **meta) -> DataProto:
        """`group_call` (a worker group method) on the batch in dispatch order; its per-token outputs `keys`
        (worker key → our key) as (B, T-1) tensors in the batch's own order. The call's round trip is timed as
        `<phase>_call`."""
        self._sleep_rollout()
        with self._timer(f"{phase}_prepare"):
            ordered, restore = self._in_dispatch_order(batch)
            data = vl.worker_input(ordered, token_keys, **meta)
        with self._timer(f"{phase}_call"):
            output = group_call(data)
        tensors = {ours: self._token_output(output, data, ordered, theirs) for theirs, ours in keys.items()}
        return DataProto.from_dict(tensors={k: v if restore is None else v[restore] for k, v in tensors.items()})

    def compute_log_prob(self, batch: DataProto) -> DataProto:
        return self._per_token_outputs("old_log_prob", self.workers.actor.compute_log_prob, batch,
                                       {"log_probs": "old_log_probs", "entropy": "entropys"}, ("response_mask",),
                                       temperature=self.temperature, calculate_entropy=True, compute_loss=False)

    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        if not self.has_ref:
            raise ValueError("no reference model: set actor_rollout_ref.actor.use_ref=True")
        group = self.workers.actor
        call = group.compute_log_prob if self.ref_in_actor else group.compute_ref_log_prob
        return self._per_token_outputs("ref", call, batch, {"log_probs": "ref_log_prob"}, ("response_mask",),
                                       temperature=self.temperature, calculate_entropy=False, compute_loss=False,
                                       **({"no_lora_adapter": True} if self.ref_in_actor else {}))

    def compute_values(self, batch: DataProto) -> DataProto:
        values = self._per_token_outputs("values", lambda data: self.workers.critic.infer_batch(data).get(), batch,
                                         {"values": "values"}, ("response_mask",), temperature=self.temperature,
                                         compute_loss=False)
        values.batch["values"] = values.batch["values"] * batch.batch["response_mask"]
        return values

    # ---------------------------------------------------------------- updates

    def _update_meta(self, role_cfg: DictConfig) -> dict:
        return update_meta(role_cfg, self.temperature, int(self.verl_cfg.actor_rollout_ref.actor.data_loader_seed))

    def update_critic(self, batch: DataProto) -> dict[str, float]:
        self._sleep_rollout()
        with self._timer("update_critic_prepare"):
            batch, _ = self._in_dispatch_order(batch)
            data = vl.worker_input(batch, ("response_mask", "values", "returns"), **self._update_meta(self.cfg.critic))
        with self._timer("update_critic_call"):
            output = self.workers.critic.train_mini_batch(data).get()
        return _metrics(tu.get(output, "metrics"), "critic/")

    def update_actor(self, batch: DataProto) -> dict[str, float]:
        actor = self.cfg.actor_rollout_ref.actor
        self._sleep_rollout()
        with self._timer("update_actor_prepare"):
            batch, _ = self._in_dispatch_order(batch)
            keys = ("response_mask", "old_log_probs", "advantages") + (("ref_log_prob",) if actor.use_kl_loss else ())
            data = vl.worker_input(batch, keys, calculate_entropy=actor.entropy_coeff != 0, compute_loss=True,
                                   distillation_use_topk=False, distillation_only=False, **self._update_meta(actor))
        with self._timer("update_actor_call"):
            output = self.workers.actor.update_actor(data)
        self._actor_updates += 1
        return _metrics(tu.get(output, "metrics"), "actor/")

    # ---------------------------------------------------------------- checkpoints

    def save(self, directory: Path) -> None:
        """verl's FSDP checkpoints: `<dir>/actor` and `<dir>/critic` (sharded model, optimizer, RNG) with a Hugging
        Face export in `<role>/huggingface`. Multi-node: `directory` must be on a filesystem every node sees."""
        self._sleep_rollout()
        for role, group in (("actor", self.workers.actor), ("critic", self.workers.critic)):
            group.save_checkpoint(str(Path(directory) / role), hdfs_path=None, global_step=self._actor_updates,
                                  max_ckpt_to_keep=None)

    def load(self, directory: Path) -> None:
        self._sleep_rollout()
        for role, group in (("actor", self.workers.actor), ("critic", self.workers.critic)):
            group.load_checkpoint(str(Path(directory) / role))


def conversation_key(prompt: Prompt) -> str:
    """Routing key of a prompt: its conversation's first two messages (system prompt and first observation).

    verl's load balancer sends the requests of one key to one rollout server (sticky sessions: `request_id`, while
    vLLM gets a fresh id per request), so a trajectory's later turns, and the trajectories of a group (one start
    state), find their shared prefix in that engine's prefix cache instead of prefilling it again elsewhere.
    """
    return hashlib.sha1(json.dumps(prompt.messages[:2], sort_keys=True).encode()).hexdigest()


def request_options(rollout_name: str) -> dict:
    """Sampling options of every request for the engine: with vLLM, only the finished output, as token ids. verl's
    server keeps only the last of vLLM's outputs of a request and the driver decodes the ids itself, so an output
    per decoding step (vLLM's default) and its incremental detokenisation would be work for nothing."""
    if rollout_name != "vllm":
        return {}
    from vllm.sampling_params import RequestOutputKind

    return {"output_kind": RequestOutputKind.FINAL_ONLY, "detokenize": False}


def update_meta(role_cfg: DictConfig, temperature: float, seed: int) -> dict:
    """How verl's train_mini_batch splits the batch of one role (actor or critic): mini-batches, epochs,
    shuffling (RayPPOTrainer's keys)."""
    mini = int(role_cfg.ppo_mini_batch_size)
    return {"temperature": temperature, "global_batch_size": mini, "mini_batch_size": mini,
            "epochs": int(role_cfg.ppo_epochs), "seed": seed, "dataloader_kwargs": {"shuffle": bool(role_cfg.shuffle)}}

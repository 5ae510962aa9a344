"""The PPO driver: RAGEN's agent trainer loop (spec §10.3) over any backend of `backend.WorkerGroup`.

One step is a list of named, timed phases (`timing_s/<phase>`; with the local backend on a GPU also each phase's
peak memory, `memory_gb/<phase>`, and the memory the process holds, `memory_gb/reserved`):

    gen            rollout through LLMAgentProxy (env_groups × group_size trajectories, up to max_turn turns)
    filter         StarPO-S: keep the groups with the most spread-out scores (then, with
                   algorithm.drop_zero_variance_groups, drop those whose scores are all equal; a step left with
                   none skips the phases below); response_mask := loss_mask
    old_log_prob   actor log-probs of the batch (and entropies); with actor.old_log_prob_from_update, where the
                   update is the step's only optimizer step, none: update_actor's forward gives them
    ref            reference log-probs (when a reference model exists: every step for a KL loss or KL-in-reward,
                   else every trainer.diagnostics.kl_freq steps for the diagnostics' KL to the reference)
    diagnostics    span entropies, KL to the reference; every trainer.diagnostics.mi_freq steps the input
                   dependence of the reasoning (one extra log-prob pass; diagnostics.py, docs/diagnostics.md)
    values         critic values (GAE only: the other estimators have no critic)
    adv            rewards (optionally minus β·KL) and GAE / bi-level GAE / critic-free (GRPO, RLOO, …) advantages
    update_critic  clipped value loss, one pass of mini-batches (GAE only)
    update_actor   clipped policy loss − entropy bonus (+ KL loss), after critic_warmup steps
    testing        validation rollouts (`val-env/*`; world-model accuracy in add_worldmodel prompts) every test_freq
                   steps, at the steps trainer.test_steps lists and at the last step
    save_checkpoint  every save_freq steps, at the last step, and at the step that runs past trainer.max_wall_s
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm
from verl import DataProto
from verl.trainer.ppo import core_algos

from SPA_agent.runs import checkpoints
from SPA_agent.runs.metrics_logger import MetricsLogger
from SPA_agent.runs.progress import plain_line, progress_bar
from SPA_agent.selfplay.worldmodel import worldmodel_accuracy
from SPA_agent.trainer import algos
from SPA_agent.trainer.backend import WorkerGroup
from SPA_agent.trainer.diagnostics import Diagnostics
from SPA_agent.trainer.generations_log import GenerationsLog
from SPA_agent.trainer.metrics import (
    CudaMemory,
    FullCollections,
    PhaseTimer,
    data_metrics,
    mean_metrics,
    prefixed,
)


class WallTimeReached(Exception):
    """`trainer.max_wall_s` ran out: the run stopped after `step` of `total` steps with a checkpoint of that step,
    so the same command (resume_mode=auto) continues it."""

    def __init__(self, step: int, total: int, seconds: float):
        super().__init__(f"stopped after step {step} of {total}: {seconds:.0f} s of training reached "
                         "trainer.max_wall_s; its checkpoint is saved")
        self.step, self.total, self.seconds = step, total, seconds


class RewardSignalLost(Exception):
    """`trainer.stop_after_uniform_scores`: every trajectory of the last `streak` rollouts scored the same (`score`),
    so the reward no longer tells one action from another (GRPO's advantages are all 0; docs/ppo.md's format
    collapse, where every answer is malformed). The run stopped after `step` of `total` steps, validated and saved."""

    def __init__(self, step: int, total: int, streak: int, score: float):
        super().__init__(f"stopped after step {step} of {total}: every trajectory scored {score:g} in each of the last "
                         f"{streak} steps (trainer.stop_after_uniform_scores), so no reward tells the actions apart; "
                         "a checkpoint of that step is saved")
        self.step, self.total, self.streak, self.score = step, total, streak, score


class PPOTrainer:
    """Owns the loop; the backend owns the models, the proxy owns the environments."""

    def __init__(self, cfg: DictConfig, backend: WorkerGroup, proxy, logger: MetricsLogger,
                 diagnostics: Diagnostics | None = None):
        """`diagnostics`: the RL-health metrics to log (main_ppo builds them; None logs none)."""
        self.cfg, self.backend, self.proxy, self.logger = cfg, backend, proxy, logger
        self.diagnostics = diagnostics
        self.output_dir = Path(cfg.trainer.default_local_dir)
        self.generations = GenerationsLog(self.output_dir, cfg.trainer.get("log_val_generations") or 0)
        self.total_steps = int(cfg.trainer.total_training_steps)
        self.kl_ctrl = core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)
        self.use_critic = algos.needs_critic(cfg.algorithm.adv_estimator)
        self.test_steps = set(cfg.trainer.test_steps)
        # the reference pass's every-step readers; without them it runs every diagnostics.kl_freq steps (0 = never)
        self.ref_every_step = bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)
        self.kl_freq = int(cfg.trainer.diagnostics.kl_freq)
        self.global_step = 0
        self.uniform_streak = 0  # steps in a row whose rollout scored every trajectory the same (this call's)
        self.last_uniform_score: float | None = None  # that score, at the last step

    # ---------------------------------------------------------------- the loop

    def fit(self) -> None:
        """Train from the current (possibly resumed) step to trainer.total_training_steps; raise WallTimeReached
        (after saving) at the end of the first step that ends past trainer.max_wall_s seconds of this call, and
        RewardSignalLost (after validating and saving, as at the last step) at the end of the trainer.
        stop_after_uniform_scores-th step in a row whose rollout scored every trajectory the same."""
        trainer_cfg = self.cfg.trainer
        started, max_wall_s = time.monotonic(), trainer_cfg.get("max_wall_s")
        max_uniform = trainer_cfg.get("stop_after_uniform_scores")
        if self.global_step == 0 and trainer_cfg.val_before_train and trainer_cfg.test_freq > 0:
            self.logger.log(self.validate(step=0), step=0)
        steps = range(self.global_step + 1, self.total_steps + 1)
        for step in progress_bar(steps, desc="ppo", initial=self.global_step, total=self.total_steps, lines=False):
            timer = PhaseTimer(report=lambda phase, seconds, step=step: _report_phase(step, phase, seconds),
                               memory=_cuda_memory(self.backend))
            with timer("step"), FullCollections() as collections:
                metrics = self.train_step(step, timer)
                signal_lost = max_uniform is not None and self.uniform_streak >= max_uniform
                last = step == self.total_steps or signal_lost
                if trainer_cfg.test_freq > 0 and (step % trainer_cfg.test_freq == 0 or step in self.test_steps or last):
                    with timer("testing"):
                        metrics.update(self.validate(step))
                self.global_step = step
                out_of_time = max_wall_s is not None and time.monotonic() - started >= max_wall_s and not last
                if (trainer_cfg.save_freq > 0 and step % trainer_cfg.save_freq == 0) or last or out_of_time:
                    with timer("save_checkpoint"):
                        self.save()
            self.logger.log({**metrics, **timer.metrics(), "timing_s/gc_full": collections.seconds}, step=step)
            if out_of_time:
                raise WallTimeReached(step, self.total_steps, time.monotonic() - started)
            if signal_lost and step < self.total_steps:
                raise RewardSignalLost(step, self.total_steps, self.uniform_streak, self.last_uniform_score)

    def train_step(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        """One PPO iteration; returns its metrics (timings are added to `timer`)."""
        with timer("gen"):
            rollout = self.proxy.rollout(val=False)
        metrics = prefixed("train", self._rollout_metrics(rollout))
        metrics["rollout/first_seed"] = float(rollout.batch.non_tensor_batch["seeds"].min())
        self.last_uniform_score = algos.uniform_score(rollout.batch.batch["rm_scores"])
        self.uniform_streak = self.uniform_streak + 1 if self.last_uniform_score is not None else 0
        metrics["rollout/uniform_score_streak"] = float(self.uniform_streak)
        with timer("filter"):
            batch, filter_metrics = self.filter_batch(rollout.batch)
        metrics.update(filter_metrics)
        if len(batch) == 0:  # every group dropped by algorithm.drop_zero_variance_groups: nothing to learn from
            return metrics
        from_update = self.old_log_prob_from_update(step, batch)
        if not from_update:
            with timer("old_log_prob"):
                batch = batch.union(self.backend.compute_log_prob(batch))
        if self.backend.has_ref and self.ref_due(step):
            with timer("ref"):
                batch = batch.union(self.backend.compute_ref_log_prob(batch))
        if self.diagnostics is not None:
            with timer("diagnostics"):
                if not from_update:
                    metrics.update(self.diagnostics.step_metrics(batch, rollout.batch, step))
                elif self.diagnostics.due(step):  # the policy that sampled; its span metrics follow the update
                    metrics.update(self.diagnostics.input_dependence(rollout.batch, step))
        if self.use_critic:
            with timer("values"):
                batch = batch.union(self.backend.compute_values(batch))
        with timer("adv"):
            metrics.update(self.compute_advantage(batch))
        if self.use_critic:
            with timer("update_critic"):
                metrics.update(self.backend.update_critic(batch))
        if step > self.cfg.trainer.critic_warmup:
            with timer("update_actor"):
                metrics.update(self.backend.update_actor(batch))
        if from_update and self.diagnostics is not None:
            with timer("diagnostics"):
                metrics.update(self.diagnostics.batch_metrics(batch))
        metrics.update(data_metrics(batch))
        metrics.update(self.backend.step_timings())
        metrics["perf/total_num_tokens"] = float(batch.batch["attention_mask"].sum())
        return metrics

    # ---------------------------------------------------------------- phases

    def old_log_prob_from_update(self, step: int, batch: DataProto) -> bool:
        """Whether the update's forward gives this step's old log-probs (actor.old_log_prob_from_update): where it
        is the step's only optimizer step (one epoch, checked with the config; the kept batch one mini-batch) and
        the actor updates at all (not a critic warm-up step)."""
        actor = self.cfg.actor_rollout_ref.actor
        return (bool(actor.get("old_log_prob_from_update")) and len(batch) <= actor.ppo_mini_batch_size
                and step > self.cfg.trainer.critic_warmup)

    def ref_due(self, step: int) -> bool:
        """Whether the reference pass runs at `step`: every step when a KL loss or KL-in-reward reads it, else every
        trainer.diagnostics.kl_freq steps (0 = never), for the diagnostics' KL to the reference (`diag/kl_ref/*`),
        which is all it feeds then: at ~0.2 s a step of SmolLM2's ~5 s, a run can measure it less often."""
        return self.ref_every_step or (self.kl_freq > 0 and step % self.kl_freq == 0)

    def filter_batch(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """StarPO-S filter, then the training view of the batch: `response_mask := loss_mask`.

        The rollout's own `response_mask` (the model's sampled tokens) is kept as `assistant_mask`; the
        rollout scores become `token_level_scores` (spec §10.3 steps 2–4).
        """
        rollout_cfg = self.cfg.actor_rollout_ref.rollout
        group_size = int(self.cfg.es_manager.train.group_size)
        _check_groups_are_consecutive(batch, group_size)
        rows, metrics = algos.rollout_filter(
            batch.batch["rm_scores"], group_size, rollout_cfg.rollout_filter_ratio, rollout_cfg.rollout_filter_type
        )
        kept = batch.select_idxs(rows.numpy())
        if self.cfg.algorithm.get("drop_zero_variance_groups"):
            rows, dropped = algos.drop_zero_variance_groups(kept.batch["rm_scores"], group_size)
            kept = kept.select_idxs(rows.numpy())
            metrics.update(dropped)
        tensors = kept.batch
        tensors["assistant_mask"] = tensors["response_mask"]
        tensors["response_mask"] = tensors["loss_mask"].float()
        tensors["token_level_scores"] = tensors["rm_scores"].float()
        return kept, metrics

    def compute_advantage(self, batch: DataProto) -> dict[str, float]:
        """Adds `token_level_rewards`, `advantages`, `returns` to the batch; returns KL-in-reward metrics."""
        algo, t = self.cfg.algorithm, batch.batch
        metrics = {}
        if algo.use_kl_in_reward:
            t["token_level_rewards"], kl = algos.apply_kl_penalty(
                t["token_level_scores"], t["old_log_probs"], t["ref_log_prob"], t["response_mask"],
                self.kl_ctrl.value, algo.kl_penalty,
            )
            metrics = {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": self.kl_ctrl.value}
            self.kl_ctrl.update(current_kl=kl, n_steps=len(batch))
        else:
            t["token_level_rewards"] = t["token_level_scores"]
        t["advantages"], t["returns"] = algos.compute_advantages(
            t["token_level_rewards"], t.get("values"), t["response_mask"], t["assistant_mask"],
            gamma=algo.gamma, lam=algo.lam, bi_level=algo.bi_level_gae, high_level_gamma=algo.high_level_gamma,
            estimator=algo.adv_estimator, group_ids=batch.non_tensor_batch.get("group_ids"),
            norm_adv_by_std_in_grpo=algo.get("norm_adv_by_std_in_grpo", True), turns=_turns(batch, algo),
        )
        return metrics

    @torch.no_grad()
    def validate(self, step: int | None = None) -> dict[str, float]:
        """`validation_steps` validation rollouts (same seeds each time), env metrics and rollout diagnostics
        averaged, as `val-env/*`; in add_worldmodel prompts also the world model's accuracy
        (`val-env/<Tag>/worldmodel/*`: its observations and predictions against the true states), so a run cut
        short still has it at its last validation. With a `step`, the first rollout's trajectories that
        trainer.log_val_generations asks for go to val_generations.jsonl as text."""
        runs = []
        for index in range(self.cfg.trainer.validation_steps):
            rollout = self.proxy.rollout(val=True)
            if index == 0 and step is not None:
                self.generations.log(step, self.proxy, rollout.states)
            metrics = self._rollout_metrics(rollout)
            if self.proxy.ctx.mode == "add_worldmodel":
                metrics.update(worldmodel_accuracy(rollout.states))
            runs.append(metrics)
        return prefixed("val-env", mean_metrics(runs))

    def _rollout_metrics(self, rollout) -> dict[str, float]:
        """The rollout's env metrics and, with diagnostics, its format-valid rate and distinct ratios."""
        if self.diagnostics is None:
            return dict(rollout.metrics)
        return {**rollout.metrics, **self.diagnostics.rollout_metrics(rollout)}

    # ---------------------------------------------------------------- checkpoints

    def save(self) -> Path:
        trainer_cfg = self.cfg.trainer
        state = {"proxy": self.proxy.state_dict(), "kl_coef": self.kl_ctrl.value,
                 "generator": _generator_state(self.backend)}
        keep = {"actor": trainer_cfg.max_actor_ckpt_to_keep, "critic": trainer_cfg.max_critic_ckpt_to_keep}
        return checkpoints.save_checkpoint(self.output_dir, self.global_step, self.backend.save, state, keep)

    def resume(self) -> int:
        """With resume_mode=auto, load the latest checkpoint under default_local_dir; the step resumed from."""
        if self.cfg.trainer.resume_mode != "auto":
            return 0
        step = checkpoints.latest_step(self.output_dir)
        if step is None:  # stopped before its first checkpoint: the run starts over and logs step 0 again
            self.logger.truncate_after(-1)
            self.generations.truncate_after(-1)
            return 0
        self.backend.load(checkpoints.step_dir(self.output_dir, step))
        state = checkpoints.load_trainer_state(self.output_dir, step)
        self.proxy.load_state_dict(state["proxy"])
        self.kl_ctrl.value = state["kl_coef"]
        _load_generator_state(self.backend, state.get("generator"))
        checkpoints.set_rng_state(state["rng"])
        self.global_step = step
        self.logger.truncate_after(step)
        self.generations.truncate_after(step)
        tqdm.write(f"resumed from {checkpoints.step_dir(self.output_dir, step)}")
        return step


def _report_phase(step: int, phase: str, seconds: float) -> None:
    """A redirected log's line per finished phase (the whole step is the metric logger's line)."""
    if phase != "step":
        plain_line(f"step {step}: {phase} done ({seconds:.1f} s)")


def _turns(batch: DataProto, algo: DictConfig) -> dict | None:
    """What GiGPO's step-level grouping reads (None for the other estimators)."""
    if algo.adv_estimator != "gigpo":
        return None
    return {"turn_states": batch.non_tensor_batch["turn_states"], "turn_rewards": batch.non_tensor_batch["turn_rewards"],
            "step_gamma": algo.step_gamma, "step_weight": algo.step_weight}


def _check_groups_are_consecutive(batch: DataProto, group_size: int) -> None:
    """The filter ranks blocks of `group_size` consecutive rows: they must be the rollout's groups."""
    group_ids = batch.non_tensor_batch.get("group_ids")
    if group_ids is None:
        return
    blocks = group_ids.reshape(-1, group_size)
    if not (blocks == blocks[:, :1]).all():
        raise ValueError("rollout rows are not ordered by group (group_size consecutive rows per group)")


def _cuda_memory(backend: WorkerGroup) -> CudaMemory | None:
    """The memory of the backend's GPU where it runs in this process (the local backend on CUDA); verl's workers
    are other processes."""
    device = getattr(backend, "device", None)
    return CudaMemory(device) if isinstance(device, torch.device) and device.type == "cuda" else None


def _generator_state(backend: WorkerGroup) -> dict | None:
    """The sampling state of generators that expose one (so a resumed run samples as an unbroken one)."""
    generator = getattr(backend, "generator", None)
    return generator.state_dict() if hasattr(generator, "state_dict") else None


def _load_generator_state(backend: WorkerGroup, state: dict | None) -> None:
    generator = getattr(backend, "generator", None)
    if state is not None and hasattr(generator, "load_state_dict"):
        generator.load_state_dict(state)

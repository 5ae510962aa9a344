"""`local` backend: actor, critic and reference policy in one process on one device (CPU or one GPU).

Log-probs and values are computed in micro-batches over all T-1 positions; updates follow spec §10.3 steps 7–8
with the losses of `verl.trainer.ppo.core_algos`. Gradients accumulate over the micro-batches of a mini-batch
with the loss normalised by the mini-batch's token (or trajectory) count, so the update does not depend on
the micro-batch size. Micro-batches are either fixed row counts or token budgets (`use_dynamic_bsz`), run padded
or packed without padding (`use_remove_padding`; trainer/packing.py): the losses see the same (b, T-1) tensors
either way. Generation goes through the generator interface using the actor's current weights. With
`<role>.model.lora_rank > 0` the actor and critic train LoRA adapters and the reference policy is the actor with
its adapters disabled (`lora.py`). With `actor_rollout_ref.model.liger_training` the passes run Liger's fused
RMSNorm, SwiGLU and rotary kernels on a CUDA GPU (`liger_decode.fused_kernels`, for the duration of each pass).
With `actor.sft_aux_coef > 0` every actor optimizer step adds that coefficient times the SFT cross-entropy of
`actor.sft_aux_rows` rows of the SFT data to the PPO loss (PPO-ptx, `trainer/sft_aux.py`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F
from verl.workers.config import ActorConfig

from sft.packing import token_loss_sum
from SPA_agent.generators import liger_decode
from SPA_agent.model_presets import resolve_model_path
from SPA_agent.runs.lora import add_lora
from SPA_agent.trainer.algos import needs_critic
from SPA_agent.trainer.local_backend import lora
from SPA_agent.trainer.local_backend import models as lm
from SPA_agent.trainer.packing import avoid_cudnn_attention, enable_packed_attention, micro_batch_plan
from SPA_agent.trainer.sft_aux import SftAuxData

OPTIMIZER_FILE = "optimizer.pt"
#: the switch of Liger's kernels in the training models (the generator's is generator.liger_kernels)
LIGER_TRAINING = "actor_rollout_ref.model.liger_training"


def resolve_device(name: str) -> torch.device:
    """`auto` → cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={name} but no CUDA device is visible; use trainer.device=cpu")
    return torch.device(name)


@dataclass
class Trainable:
    """A model with its AdamW optimizer, constant-with-warmup LR schedule and gradient clipping."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    grad_clip: float

    @classmethod
    def build(cls, model: nn.Module, optim: DictConfig, grad_clip: float, total_steps: int) -> Trainable:
        optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=optim.lr, betas=tuple(optim.betas),
                                      weight_decay=optim.weight_decay)
        warmup = optim.get("lr_warmup_steps") or -1
        if warmup < 0:
            warmup = int(optim.get("lr_warmup_steps_ratio", 0.0) * total_steps)
        scheduler = verl_F.get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
        return cls(model, optimizer, scheduler, grad_clip)

    def clip_and_step(self) -> float:
        """Clip gradients, step the optimizer unless the norm is not finite, clear gradients; the norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(lora.trainable_parameters(self.model), self.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.item()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _loss_normalisers(mask: torch.Tensor, loss_scale_factor: int | None = None) -> dict:
    """`agg_loss` arguments that make micro-batch losses add up to the mini-batch's aggregate (and the constant
    divisor of seq-mean-token-sum-norm, None = verl's default: the padded length)."""
    return {"dp_size": 1, "batch_num_tokens": mask.sum().item(), "global_batch_size": (mask.sum(-1) > 0).sum().item(),
            "loss_scale_factor": loss_scale_factor}


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]} if rows else {}


def limit_gpu_share(device: torch.device, fraction: float) -> None:
    """Caps this process's allocator at `fraction` of `device`'s memory; `cuda` without an index means the current
    GPU (torch's setter takes only an indexed device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)


class LocalBackend:
    """The worker group of `trainer.backend=local` (see backend.WorkerGroup for the contract)."""

    def __init__(self, cfg: DictConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.device = resolve_device(cfg.trainer.device)
        if self.device.type == "cuda":
            avoid_cudnn_attention()
            if (fraction := cfg.trainer.get("cuda_memory_fraction")) is not None:
                limit_gpu_share(self.device, float(fraction))
        arr = cfg.actor_rollout_ref
        self.model_path = resolve_model_path(arr.model.path)
        total_steps = cfg.trainer.total_training_steps
        self.actor = Trainable.build(self._load_actor(), arr.actor.optim, arr.actor.grad_clip, total_steps)
        self.critic = self._build_critic(cfg) if needs_critic(cfg.algorithm.adv_estimator) else None
        self.has_ref = bool(arr.actor.use_ref)
        # with LoRA the reference is the actor with its adapters disabled: no second copy of the weights
        ref_device = torch.device("cpu") if arr.ref.offload_to_cpu else self.device
        self.ref = lm.load_reference(self.model_path, ref_device) \
            if self.has_ref and not lora.is_lora(self.actor.model) else None
        self.packed_actor = bool(arr.model.use_remove_padding)
        self.packed_critic = self.critic is not None and bool(cfg.critic.model.use_remove_padding)
        for model, packed in ((self.actor.model, self.packed_actor), (self.ref, self.packed_actor),
                              (self.critic.model if self.critic else None, self.packed_critic)):
            if model is not None and packed:
                enable_packed_attention(model)
        # the models whose passes run Liger's kernels: true | false | auto, as the generator's (liger_decode.resolve)
        liger = OmegaConf.select(cfg, LIGER_TRAINING, default=False)
        self.liger_models = [model for model in (self.actor.model, self.ref, self.critic.model if self.critic else None)
                             if model is not None and liger_decode.resolve(liger, model, LIGER_TRAINING)]
        self.temperature = float(arr.rollout.temperature)
        self.policy_loss_fn = core_algos.get_policy_loss_fn(arr.actor.policy_loss.loss_mode)
        self.policy_loss_cfg = ActorConfig(
            strategy="local", rollout_n=1, ppo_micro_batch_size_per_gpu=arr.actor.ppo_micro_batch_size_per_gpu,
            clip_ratio=arr.actor.clip_ratio, clip_ratio_low=arr.actor.clip_ratio_low,
            clip_ratio_high=arr.actor.clip_ratio_high, clip_ratio_c=arr.actor.clip_ratio_c,
            loss_agg_mode=arr.actor.loss_agg_mode,
        )
        # PPO-ptx: rows of the SFT data whose cross-entropy joins the actor's loss (None when sft_aux_coef is 0)
        self.sft_aux = SftAuxData(arr.actor.sft_aux_files, tokenizer, arr.actor.sft_aux_rows, cfg.trainer.seed,
                                  self.packed_actor, arr.actor.ppo_max_token_len_per_gpu) \
            if arr.actor.get("sft_aux_coef", 0) > 0 else None
        self._generator = None
        self._rollout_model: nn.Module | None = None

    def _load_actor(self) -> nn.Module:
        """The policy from `model.path`, wrapped with LoRA adapters when `model.lora_rank > 0`."""
        model_cfg = self.cfg.actor_rollout_ref.model
        actor = lm.load_actor(self.model_path, self.device, model_cfg.enable_gradient_checkpointing)
        return add_lora(actor, model_cfg, "actor_rollout_ref.model")

    def _load_critic(self) -> nn.Module:
        """The value model from `critic.model.path` (LoRA adapters when `critic.model.lora_rank > 0`); its value
        head's init depends on trainer.seed only."""
        model_cfg = self.cfg.critic.model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.trainer.seed)
            critic = lm.load_critic(resolve_model_path(model_cfg.path), self.device,
                                    model_cfg.enable_gradient_checkpointing)
            return add_lora(critic, model_cfg, "critic.model", value_model=True)

    def _build_critic(self, cfg: DictConfig) -> Trainable:
        critic_cfg = cfg.critic
        return Trainable.build(self._load_critic(), critic_cfg.optim, critic_cfg.grad_clip,
                               cfg.trainer.total_training_steps)

    def _trainables(self) -> dict[str, Trainable]:
        """The trained models by checkpoint role: actor, and critic when the estimator has one."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    # ---------------------------------------------------------------- generation

    @property
    def generator(self):
        """The configured generator (`generator` config group) over the actor's weights; built on first use.

        On GPU `hf` samples from a bf16 copy of the actor (refreshed after every update), so decoding runs in
        bf16 with the generator's own KV caches; on CPU it samples from the float32 actor itself. With LoRA the
        copy is a plain model holding the merged weights, and on CPU the adapted model samples.
        """
        if self._generator is None:
            from SPA_agent.generators import build_generator

            actor = self.actor.model
            if self.device.type == "cuda" and self.cfg.generator.name == "hf":
                self._rollout_model = lm.rollout_copy(actor, torch.bfloat16)
            model = self._rollout_model if self._rollout_model is not None else lora.adapted_model(actor)
            self._generator = build_generator(self.cfg.generator, self.model_path, self.tokenizer, model=model)
            self._refresh_generator_weights()  # e.g. a resumed actor's weights into an engine built from model_path
        return self._generator

    def generate(self, prompts: list) -> list:
        with torch.no_grad():
            return self.generator.generate(prompts)

    @property
    def can_serve(self) -> bool:
        """Whether the generator runs pipelined turns (`serve`; LLMAgentProxy, agent_proxy.pipeline_turns)."""
        return bool(getattr(self.generator, "can_serve", False))

    def serve(self, prompts: list, respond) -> None:
        with torch.no_grad():
            self.generator.serve(prompts, respond)

    @torch.no_grad()
    def _refresh_generator_weights(self) -> None:
        """Copies of the weights held for generation (bf16 rollout model, vLLM engine) get the actor's (merged
        with its adapters under LoRA)."""
        if self._rollout_model is not None:
            lm.copy_weights(self._rollout_model, lora.generation_weights(self.actor.model))
        update = getattr(self._generator, "update_weights", None)
        if update is not None:
            update(lora.generation_weights(self.actor.model))

    # ---------------------------------------------------------------- inference passes

    def _kernels(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Liger's kernels in `model` for a pass where actor_rollout_ref.model.liger_training resolved on for it:
        open over the forward and the backward passes (gradient checkpointing re-runs the forward in the backward),
        transformers' modules outside (the generator's rollout copy is made from those)."""
        if any(model is fused for fused in self.liger_models):
            return liger_decode.fused_kernels(model)
        return contextlib.nullcontext()

    @staticmethod
    def _plan(batch: DataProto, micro: int, dynamic: bool, budget: int) -> list[list[int]]:
        """Row indices of each micro-batch: `micro` rows each, or at most `budget` tokens each when `dynamic`."""
        return micro_batch_plan(batch.batch["attention_mask"], micro, dynamic, budget)

    @staticmethod
    def _in_batch_order(parts: list[torch.Tensor], plan: list[list[int]]) -> torch.Tensor:
        """Micro-batch outputs (in plan order, on the device) back in the batch's row order, on the host: one copy
        to the host a pass, so the host does not wait for each micro-batch before it queues the next."""
        out = torch.cat(parts)
        order = torch.tensor([row for rows in plan for row in rows], device=out.device)
        return out[torch.argsort(order)].cpu()

    @torch.no_grad()
    def _log_probs(self, model: nn.Module, batch: DataProto, plan: list[list[int]], with_entropy: bool):
        model.eval()
        device = next(model.parameters()).device
        log_probs, entropies = [], []
        with self._kernels(model):
            for mb in lm.micro_batches(batch, plan, lm.MODEL_INPUT_KEYS, device):
                with lm.autocast(device):
                    lp, ent = lm.token_log_probs(model, mb, self.temperature, with_entropy, packed=self.packed_actor)
                log_probs.append(lp)
                entropies.append(ent)
        return (self._in_batch_order(log_probs, plan),
                self._in_batch_order(entropies, plan) if with_entropy else None)

    def compute_log_prob(self, batch: DataProto) -> DataProto:
        cfg = self.cfg.actor_rollout_ref.rollout
        plan = self._plan(batch, cfg.log_prob_micro_batch_size_per_gpu, cfg.log_prob_use_dynamic_bsz,
                          cfg.log_prob_max_token_len_per_gpu)
        log_probs, entropy = self._log_probs(self.actor.model, batch, plan, with_entropy=True)
        return DataProto.from_dict(tensors={"old_log_probs": log_probs, "entropys": entropy})

    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        if not self.has_ref:
            raise ValueError("no reference model: set actor_rollout_ref.actor.use_ref=True")
        cfg = self.cfg.actor_rollout_ref.ref
        plan = self._plan(batch, cfg.log_prob_micro_batch_size_per_gpu, cfg.log_prob_use_dynamic_bsz,
                          cfg.log_prob_max_token_len_per_gpu)
        if self.ref is not None:
            log_probs, _ = self._log_probs(self.ref, batch, plan, with_entropy=False)
        else:  # LoRA: the base model is the actor without its adapters
            with self.actor.model.disable_adapter():
                log_probs, _ = self._log_probs(self.actor.model, batch, plan, with_entropy=False)
        return DataProto.from_dict(tensors={"ref_log_prob": log_probs})

    @torch.no_grad()
    def compute_values(self, batch: DataProto) -> DataProto:
        cfg, model = self.cfg.critic, self.critic.model.eval()
        keys = (*lm.MODEL_INPUT_KEYS, "response_mask")
        plan = self._plan(batch, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                          cfg.forward_max_token_len_per_gpu)
        values = []
        with self._kernels(model):
            for mb in lm.micro_batches(batch, plan, keys, self.device):
                with lm.autocast(self.device):
                    values.append(lm.token_values(model, mb, packed=self.packed_critic) * mb["response_mask"])
        return DataProto.from_dict(tensors={"values": self._in_batch_order(values, plan)})

    # ---------------------------------------------------------------- updates

    def _mini_batches(self, batch: DataProto, role_cfg: DictConfig):
        for _ in range(role_cfg.ppo_epochs):
            for start in range(0, len(batch), role_cfg.ppo_mini_batch_size):
                yield batch[start : start + role_cfg.ppo_mini_batch_size]

    def update_critic(self, batch: DataProto) -> dict[str, float]:
        """Clipped value loss (core_algos.compute_value_loss) over `response_mask`, AdamW, grad clip."""
        cfg, model = self.cfg.critic, self.critic.model.train()
        keys = (*lm.MODEL_INPUT_KEYS, "values", "returns", "response_mask")
        steps, micro_rows = [], []
        with self._kernels(model):
            for mini in self._mini_batches(batch, cfg):
                norm = _loss_normalisers(mini.batch["response_mask"], cfg.get("loss_scale_factor"))
                loss_sum = 0.0
                plan = self._plan(mini, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                  cfg.ppo_max_token_len_per_gpu)
                for mb in lm.micro_batches(mini, plan, keys, self.device):
                    with lm.autocast(self.device):
                        vpreds = lm.token_values(model, mb, packed=self.packed_critic)
                    vf_loss, vf_clipfrac = core_algos.compute_value_loss(
                        vpreds=vpreds, returns=mb["returns"], values=mb["values"], response_mask=mb["response_mask"],
                        cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode, **norm,
                    )
                    vf_loss.backward()
                    loss_sum += vf_loss.item()
                    micro_rows.append({"critic/vf_clipfrac": vf_clipfrac.item(),
                                       "critic/vpred_mean": verl_F.masked_mean(vpreds, mb["response_mask"]).item()})
                steps.append({"critic/vf_loss": loss_sum, "critic/grad_norm": self.critic.clip_and_step()})
        self.critic.scheduler.step()
        return {**_mean_metrics(steps), **_mean_metrics(micro_rows), "critic/lr": self.critic.scheduler.get_last_lr()[0]}

    def _actor_micro_loss(self, mb: dict, norm: dict, forward: list | None = None) -> tuple[torch.Tensor, dict]:
        """PPO loss of one micro-batch: clipped policy loss − entropy bonus (+ KL loss), and its metrics. Without
        `old_log_probs` in `mb` (the old log-probs from this forward), its log-probs and entropies, detached, are
        appended to `forward`."""
        cfg = self.cfg.actor_rollout_ref.actor
        mask = mb["response_mask"]
        with lm.autocast(self.device):
            log_prob, entropy = lm.token_log_probs(self.actor.model, mb, self.temperature, with_entropy=True,
                                                   packed=self.packed_actor)
        old_log_prob = mb.get("old_log_probs")
        if old_log_prob is None:
            old_log_prob = log_prob.detach()
            forward.append((old_log_prob, entropy.detach()))
        self.policy_loss_cfg.global_batch_info.update(norm)
        pg_loss, pg_metrics = self.policy_loss_fn(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=mb["advantages"],
            response_mask=mask, loss_agg_mode=cfg.loss_agg_mode, config=self.policy_loss_cfg,
        )
        entropy_loss = core_algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **norm)
        loss = pg_loss - cfg.entropy_coeff * entropy_loss
        metrics = {"actor/pg_loss": pg_loss.item(), "actor/entropy": entropy_loss.item(), **pg_metrics}
        if cfg.use_kl_loss:
            kl = core_algos.kl_penalty(log_prob, mb["ref_log_prob"], kl_penalty=cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(kl, mask, cfg.loss_agg_mode, **norm)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.item()
        return loss, metrics

    def _sft_aux_backward(self, update: int, mini_batch: int) -> float:
        """Add sft_aux_coef × the mean token cross-entropy of the SFT rows drawn for this optimizer step to the
        actor's gradients (micro-batch by micro-batch); returns that mean."""
        batches, n_loss = self.sft_aux.micro_batches(update, mini_batch)
        scale = self.cfg.actor_rollout_ref.actor.sft_aux_coef / max(n_loss, 1)
        total = 0.0
        for micro in batches:
            with lm.autocast(self.device):
                loss = token_loss_sum(self.actor.model, {key: t.to(self.device) for key, t in micro.items()})
            (loss * scale).backward()
            total += loss.item()
        return total / max(n_loss, 1)

    def update_actor(self, batch: DataProto) -> dict[str, float]:
        """PPO clipped policy update (core_algos policy loss, asymmetric + dual clip), AdamW, grad clip; plus the
        SFT loss of `sft_aux_rows` SFT rows a mini-batch when sft_aux_coef > 0.

        A batch without `old_log_probs` (actor.old_log_prob_from_update: one epoch, one mini-batch) takes them from
        the update's forward, before its only optimizer step, and gets them added with their `entropys`, as
        `compute_log_prob` would have given them."""
        cfg = self.cfg.actor_rollout_ref.actor
        update = self.actor.scheduler.last_epoch  # updates so far: restored with the checkpoint's schedule
        self.actor.model.train()
        from_update = "old_log_probs" not in batch.batch.keys()
        if from_update and (cfg.ppo_epochs != 1 or len(batch) > cfg.ppo_mini_batch_size):
            raise ValueError("old log-probs from the update's forward need one epoch and one mini-batch")
        keys = (*lm.MODEL_INPUT_KEYS, "advantages", "response_mask") + (() if from_update else ("old_log_probs",))
        keys += ("ref_log_prob",) if cfg.use_kl_loss else ()
        forward: list[tuple[torch.Tensor, torch.Tensor]] = []
        plans: list[list[int]] = []
        summed = ("actor/pg_loss", "actor/entropy", "actor/kl_loss")
        steps, micro_rows = [], []
        with self._kernels(self.actor.model):
            for index, mini in enumerate(self._mini_batches(batch, cfg)):
                norm = _loss_normalisers(mini.batch["response_mask"], cfg.get("loss_scale_factor"))
                totals: dict[str, float] = {}
                plan = self._plan(mini, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                  cfg.ppo_max_token_len_per_gpu)
                plans.append(plan)
                for mb in lm.micro_batches(mini, plan, keys, self.device):
                    loss, metrics = self._actor_micro_loss(mb, norm, forward)
                    loss.backward()
                    for key in summed:
                        if key in metrics:
                            totals[key] = totals.get(key, 0.0) + metrics.pop(key)
                    micro_rows.append(metrics)
                if self.sft_aux is not None:
                    totals["actor/sft_aux_loss"] = self._sft_aux_backward(update, index)
                steps.append({**totals, "actor/grad_norm": self.actor.clip_and_step()})
        self.actor.scheduler.step()
        self._refresh_generator_weights()
        if from_update:  # one mini-batch: its plan covers the batch
            batch.batch["old_log_probs"] = self._in_batch_order([lp for lp, _ in forward], plans[0])
            batch.batch["entropys"] = self._in_batch_order([ent for _, ent in forward], plans[0])
        return {**_mean_metrics(steps), **_mean_metrics(micro_rows), "actor/lr": self.actor.scheduler.get_last_lr()[0]}

    # ---------------------------------------------------------------- checkpoints

    def step_timings(self) -> dict[str, float]:
        return {}  # every phase is the driver's call

    def save(self, directory: Path) -> None:
        """`<role>/`: Hugging Face model (merged under LoRA, plus `adapter/`), tokenizer, optimizer state. Under
        LoRA with trainer.save_merged_lora=False only `adapter/` and the optimizer state: what `load` reads."""
        merged = self.cfg.trainer.get("save_merged_lora", True)
        for role, trainable in self._trainables().items():
            target = Path(directory) / role
            if lora.is_lora(trainable.model) and not merged:
                lora.save_adapter(trainable.model, target)
            else:
                lora.save_merged(trainable.model, target)
                self.tokenizer.save_pretrained(target)
            torch.save(trainable.state_dict(), target / OPTIMIZER_FILE)

    def load(self, directory: Path) -> None:
        """Restore weights (LoRA: the adapters, the base being `<role>.model.path`) and optimizer states."""
        loaders = {"actor": lambda p: lm.load_actor(p, torch.device("cpu"), False),
                   "critic": lambda p: lm.load_critic(p, torch.device("cpu"), False)}
        for role, trainable in self._trainables().items():
            source = Path(directory) / role
            if lora.is_lora(trainable.model):
                lora.load_adapter(trainable.model, source)
            else:
                trainable.model.load_state_dict(loaders[role](str(source)).state_dict())
            trainable.load_state_dict(torch.load(source / OPTIMIZER_FILE, map_location=self.device))
        self._refresh_generator_weights()

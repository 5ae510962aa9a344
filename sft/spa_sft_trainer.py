"""Stage 2: world-model SFT (spec §9), an FSDP2 trainer launched by torchrun.

    torchrun --standalone --nproc_per_node=4 -m sft.spa_sft_trainer data.train_files=sftdata/x/wm_train.parquet \
        data.val_files=sftdata/x/wm_val.parquet model.partial_pretrain=Qwen/Qwen2.5-1.5B-Instruct
    python -m sft.spa_sft_trainer data.train_files=... model.partial_pretrain=tiny      # one CPU process

Same code path for one CPU process (gloo) and N GPUs (NCCL, bf16). Each optimizer step takes a global batch
of `data.train_batch_size` rows (every rank draws the same shuffled indices), splits it into packed (or padded)
micro-batches spread evenly over ranks, and divides the summed token loss by the global number of trained
tokens, so the update does not depend on the micro-batch split or the number of ranks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.utils.distributed import get_free_port
from tqdm import tqdm

from sft.config_checks import check_sft_config
from sft.fsdp_model import (
    full_state_dict,
    load_model,
    merged_hf_state_dict,
    place,
    trainable_state_dict,
)
from sft.launcher_death import die_with_launcher
from sft.liger import apply_liger, fused_token_loss_sum, resolve_liger
from sft.loss_targets import LossTarget, prepare_tokenizer
from sft.packing import (
    collate_packed,
    collate_padded,
    count_loss_tokens,
    plan_packed,
    plan_padded,
    token_loss_sum,
)
from sft.spa_sft_dataset import SpaSftDataset, tokenized_dataset
from SPA_agent.entry import EXIT_INTERRUPTED, hydra_entry
from SPA_agent.model_presets import resolve_model_path
from SPA_agent.runs import atomic_io, checkpoints, run_identity
from SPA_agent.runs.compile_cache import use_persistent_compile_cache
from SPA_agent.runs.dir_lock import HOLDER_ENV, DirLock, adopt_locks_of, check_unlocked, check_writable
from SPA_agent.runs.lora import add_lora
from SPA_agent.runs.metrics_logger import MetricsLogger
from SPA_agent.runs.progress import BackgroundHeartbeat, progress_bar, quiet_library_progress
from SPA_agent.runs.tee import tee_this_process
from SPA_agent.runs.trainer_dir import TrainerDir
from SPA_agent.selfplay.data_card import check_dataset_complete, check_dataset_config

FLEX_PAD_MULTIPLE = 512
# Per split: rows, longest row, rows truncated and tokens cut (SpaSftDataset.truncation_report).
TRUNCATION_FILE = "truncation.json"
#: an SFT run's directory: besides every trainer's outputs it writes its config and the truncation report (train.log
#: is the launcher's); config keys beyond every trainer's that do not change the trained weights (data and model enter
#: the run identity by checksum; model.use_liger only swaps kernels for the same loss, so a run may resume with it
#: switched)
RUN_DIR = TrainerDir.declare(
    owned=("sft_config.yaml", TRUNCATION_FILE),
    ignored=("data.train_files", "data.val_files", "data.require_data_card", "data.config_name",
             "model.partial_pretrain", "model.use_liger", "trainer.resume", "trainer.max_ckpt_to_keep",
             "trainer.preflight_nproc", "trainer.log_file", "trainer.wandb_mode"),
    fresh_hint="pass trainer.resume=disable")
#: trainer.deterministic's environment, set before any CUDA work: cuBLAS's fixed workspace (read when cuBLAS first
#: runs; one of the values PyTorch's deterministic mode accepts, the first unless another is set) and flash-attn's
#: deterministic backward, which transformers passes on at each call (model.attn_implementation=flash_attention_2)
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC_VALUES = (":4096:8", ":16:8")
FLASH_ATTN_DETERMINISTIC = "FLASH_ATTENTION_DETERMINISTIC"


def check_attention(cfg: DictConfig, use_cuda: bool) -> None:
    """`flash_attention_2` needs the flash-attn package and a CUDA GPU: say so in one line instead of failing
    inside transformers. With it, packed rows stay padding-free: transformers reads the sample boundaries from
    the restarting position ids and calls flash-attn's variable-length kernel."""
    if cfg.model.attn_implementation != "flash_attention_2":
        return
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError("model.attn_implementation=flash_attention_2 needs the flash-attn package "
                         "(pip install flash-attn --no-build-isolation); the default `auto` needs none")
    if not use_cuda:
        raise ValueError("model.attn_implementation=flash_attention_2 runs on CUDA GPUs only; use sdpa on CPU")


def resolve_kernel_choices(cfg: DictConfig, use_cuda: bool) -> None:
    """Fill in the `auto` kernel settings: flex attention on GPU, whose block mask skips the attention between
    packed rows (SDPA's dense block-diagonal mask does not), with packed rows padded to a multiple of 512 so that
    it compiles for few shapes; SDPA and no padding on CPU. flex_attention ships with torch, so `auto` needs no
    extra package; flash_attention_2 (also padding-free on packed rows) is accepted when flash-attn is installed."""
    check_attention(cfg, use_cuda)
    if cfg.model.attn_implementation == "auto":
        cfg.model.attn_implementation = "flex_attention" if use_cuda else "sdpa"
    if cfg.data.pad_packed_to_multiple == "auto":
        flex = cfg.model.attn_implementation == "flex_attention"
        cfg.data.pad_packed_to_multiple = FLEX_PAD_MULTIPLE if flex else 0


def check_deterministic(cfg: DictConfig) -> bool:
    """Whether `trainer.deterministic` is on; a one-line ValueError when it is not a boolean, or when it meets a
    CUBLAS_WORKSPACE_CONFIG that PyTorch's deterministic mode refuses."""
    on = cfg.trainer.get("deterministic", False)
    if not isinstance(on, bool):
        raise ValueError(f"trainer.deterministic must be true or false, got {on!r}")
    workspace = os.environ.get(CUBLAS_WORKSPACE)
    if on and workspace not in (None, *CUBLAS_DETERMINISTIC_VALUES):
        raise ValueError(f"trainer.deterministic=true needs {CUBLAS_WORKSPACE} unset or one of "
                         f"{', '.join(CUBLAS_DETERMINISTIC_VALUES)}, got {workspace!r}")
    return on


@contextlib.contextmanager
def deterministic_torch() -> Iterator[None]:
    """Deterministic kernels inside the block (trainer.deterministic=true); the process's settings come back after it.

    `torch.use_deterministic_algorithms(True)` with warn_only=False: an op with no deterministic implementation raises
    instead of warning, and flash attention's backward (packed_sdpa on GPU) takes its deterministic path only then;
    Inductor (flex attention) skips the autotuning that picks kernels by timing. cuBLAS gets a fixed workspace and
    flash-attn its deterministic backward (CUBLAS_WORKSPACE, FLASH_ATTN_DETERMINISTIC: this module is the entry
    point, and the block starts before any CUDA work), and cuDNN no benchmarking.
    """
    environment = {name: os.environ.get(name) for name in (CUBLAS_WORKSPACE, FLASH_ATTN_DETERMINISTIC)}
    torch_settings = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark)
    os.environ.setdefault(CUBLAS_WORKSPACE, CUBLAS_DETERMINISTIC_VALUES[0])
    os.environ[FLASH_ATTN_DETERMINISTIC] = "1"
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        enabled, warn_only, torch.backends.cudnn.benchmark = torch_settings
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_step_settings(trainer: DictConfig) -> None:
    """`trainer.total_training_steps` and `trainer.save_freq`, which `0` or a negative value used to switch off
    without a word (a run of total_epochs worth, no mid-epoch checkpoints)."""
    steps, freq = trainer.total_training_steps, trainer.save_freq
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"trainer.total_training_steps must be an integer >= 1 or null (total_epochs worth), "
                         f"got {steps!r}")
    if freq is not None and (isinstance(freq, bool) or not isinstance(freq, int) or freq < 0):
        raise ValueError(f"trainer.save_freq must be an integer >= 0 or null (0 and null: at the end of each epoch "
                         f"only), got {freq!r}")


def barrier() -> None:
    """`dist.barrier()` where there is a process group; one rank without FSDP trains without one."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce(tensor: torch.Tensor) -> None:
    """Sum `tensor` over the ranks in place (`dist.all_reduce`); without a process group it is this rank's already."""
    if dist.is_initialized():
        dist.all_reduce(tensor)


def empty_files(files) -> list[str]:
    """The parquet files among `files` (a path or a list) that exist and hold no rows, when all of them do; stage 1
    writes an empty wm_val.parquet with data_gen.val_fraction=0."""
    paths = [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]
    empty = all(Path(path).is_file() and pq.read_metadata(path).num_rows == 0 for path in paths)
    return paths if paths and empty else []


class SftTrainer:
    """setup / train / save_checkpoint / cleanup over `cfg` (sft/config/sft_trainer.yaml)."""

    def __init__(self, cfg: DictConfig, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 init_method: str | None = None):
        self.cfg, self.rank, self.world_size, self.local_rank = cfg, rank, world_size, local_rank
        self.init_method = init_method or f"tcp://127.0.0.1:{get_free_port()}"
        self.out_dir = Path(cfg.trainer.default_local_dir)
        self.global_step = 0
        self.train_data: SpaSftDataset | None = None  # built by preflight() or setup()
        self.lock: DirLock | None = None  # the output directory's, held by rank 0 (the writer)
        self.heartbeat = BackgroundHeartbeat("sft: loading data and model", disable=rank != 0)
        self.process_settings = contextlib.ExitStack()  # what setup changes in the process; cleanup restores it

    # ---------------------------------------------------------------- setup
    def preflight(self) -> None:
        """Check config, data (complete dataset, files, schema, lengths) and the output directory (no other
        writer, same run identity when resuming) without process groups, a model or any write."""
        check_sft_config(self.cfg, self.world_size)
        check_deterministic(self.cfg)
        wanted = self.cfg.trainer.device
        use_cuda = torch.cuda.is_available() if wanted == "auto" else wanted == "cuda"
        check_attention(self.cfg, use_cuda)
        self.model_path = resolve_model_path(self.cfg.model.partial_pretrain)
        self._check_liger(use_cuda)
        self._build_data()
        self._check_output_dir()

    def setup(self) -> None:
        self.heartbeat.start()
        check_sft_config(self.cfg, self.world_size)
        self.deterministic = check_deterministic(self.cfg)
        if self.deterministic:
            self.process_settings.enter_context(deterministic_torch())
        self.model_path = resolve_model_path(self.cfg.model.partial_pretrain)
        if self.train_data is None:  # else preflight() built it in this process (finetune_ft.sh with one rank)
            self._build_data()
        resume = self._check_output_dir()
        self._init_distributed()
        torch.manual_seed(self.cfg.trainer.seed)
        self._build_model()
        self._build_optimizer()
        if self.rank == 0:
            self.lock_output_dir()
            if not resume:
                RUN_DIR.reset(self.out_dir, self.identity)
        barrier()
        resumed = self._maybe_resume() if resume else 0
        if self.rank == 0:
            checkpoints.clean_staging(self.out_dir)
            OmegaConf.save(self.cfg, self.out_dir / "sft_config.yaml")
            truncation = self.report_truncation()
            if self.deterministic:
                print(f"sft: deterministic kernels (trainer.deterministic=true, {CUBLAS_WORKSPACE}="
                      f"{os.environ[CUBLAS_WORKSPACE]})", flush=True)
            self.metrics = MetricsLogger(self.out_dir, list(self.cfg.trainer.logger), self.cfg.trainer.project_name,
                                         self.cfg.trainer.experiment_name,
                                         OmegaConf.to_container(self.cfg) | {"truncation": truncation},
                                         mode=self.cfg.trainer.get("wandb_mode", "offline"), dir=str(self.out_dir))
            self.metrics.truncate_after(resumed)

    def lock_output_dir(self) -> None:
        """Take the output directory's lock (a no-op when held): the run's first write into it."""
        if self.lock is None:
            self.lock = DirLock(self.out_dir).acquire()

    def _check_output_dir(self) -> bool:
        """Whether to continue the run in the output directory (read-only): a live writer, or a run of other
        settings, data or model when resuming, raise a one-line error."""
        if self.cfg.trainer.resume not in ("auto", "disable"):
            raise ValueError(f"trainer.resume={self.cfg.trainer.resume!r}: use auto or disable")
        data = self.cfg.data
        files = [*self.train_data.files, *(self.val_data.files if self.val_data else [])]
        inputs = {"train data": run_identity.files_checksum(self.train_data.files),
                  "model": run_identity.model_checksum(self.cfg.model.partial_pretrain)}
        if self.val_data is not None:
            inputs["val data"] = run_identity.files_checksum(self.val_data.files)
        config = OmegaConf.to_container(self.cfg, resolve=True)
        self.identity = run_identity.build_identity(config, inputs, ignore=RUN_DIR.ignored)
        check_writable(self.out_dir)
        if self.rank == 0:  # the writer: other ranks would see its own lock once it runs ahead of them
            check_unlocked(self.out_dir)
        if data.require_data_card:
            for file in files:
                check_dataset_complete(file)
                if data.config_name is not None:
                    check_dataset_config(file, data.config_name)
        return RUN_DIR.resumable(self.out_dir, self.identity, self.cfg.trainer.resume == "auto")

    def report_truncation(self) -> dict[str, dict]:
        """Print one line per split on what data.truncation cut, and write it to truncation.json."""
        splits = {"train": self.train_data, "val": self.val_data}
        reports = {name: data.truncation_report for name, data in splits.items() if data is not None}
        for name, report in reports.items():
            print(f"sft data {name}: {report.describe()}", flush=True)
        if self.empty_val_files:
            print(f"sft data val: {', '.join(self.empty_val_files)} has no rows (made with data_gen.val_fraction=0?): "
                  "no validation loss", flush=True)
        summary = {name: report.as_dict() for name, report in reports.items()}
        atomic_io.write_json(self.out_dir / TRUNCATION_FILE, summary)
        return summary

    def _init_distributed(self) -> None:
        wanted = self.cfg.trainer.device
        use_cuda = torch.cuda.is_available() if wanted == "auto" else wanted == "cuda"
        if use_cuda:
            torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank) if use_cuda else torch.device("cpu")
        resolve_kernel_choices(self.cfg, use_cuda)
        fsdp = self.cfg.trainer.get("fsdp", "auto")
        self.fsdp = fsdp is True or (fsdp == "auto" and self.world_size > 1)
        # One rank without FSDP sets up no process group: its collectives would reduce over itself alone, and on a
        # GPU NCCL would build a communicator for them. A group the caller set up is used (the collectives then run).
        if (self.fsdp or self.world_size > 1) and not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo", init_method=self.init_method,
                                    rank=self.rank, world_size=self.world_size)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("fsdp",)) \
            if self.fsdp else None

    def _build_data(self) -> None:
        from transformers import AutoTokenizer

        data = self.cfg.data
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path,
                                                       trust_remote_code=self.cfg.model.trust_remote_code)
        prepare_tokenizer(self.tokenizer, LossTarget.parse(data.loss_target))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        make = lambda name, files: tokenized_dataset(
            name, OmegaConf.to_object(files) if OmegaConf.is_list(files) else files, self.tokenizer,
            data.max_length, data.truncation, data.loss_target, data.prompt_key, data.response_key)
        self.train_data = make("train", data.train_files)
        # An empty validation file (data_gen.val_fraction=0) means no validation, as data.val_files=null does.
        self.empty_val_files = empty_files(data.val_files) if data.val_files else []
        self.val_data = make("val", data.val_files) if data.val_files and not self.empty_val_files else None
        self.steps_per_epoch = len(self.train_data) // data.train_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"the training set has {len(self.train_data)} rows, fewer than "
                             f"data.train_batch_size={data.train_batch_size}")
        check_step_settings(self.cfg.trainer)
        total = self.steps_per_epoch * self.cfg.trainer.total_epochs
        self.total_steps = min(total, self.cfg.trainer.total_training_steps or total)

    def _check_liger(self, use_cuda: bool) -> bool:
        """Whether this run uses Liger's kernels (`resolve_liger`: with model.use_liger=true the model type, read
        from its config.json, the GPU and the package are checked, a one-line error where they fail)."""
        if self.cfg.model.use_liger is False:
            return False
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=self.cfg.model.trust_remote_code)
        return resolve_liger(self.cfg.model.use_liger, config.model_type, use_cuda,
                             bool(self.cfg.trainer.deterministic))

    def _build_model(self) -> None:
        mcfg = self.cfg.model
        use_liger = self._check_liger(self.device.type == "cuda")
        model = load_model(self.model_path, mcfg, len(self.tokenizer))
        if use_liger:
            apply_liger(model)
        self.loss_sum = fused_token_loss_sum if use_liger else token_loss_sum
        model = add_lora(model, mcfg, "model")
        self.lora_scale = mcfg.lora_alpha / mcfg.lora_rank if mcfg.lora_rank > 0 else None
        self.model, self.compute = place(model, self.mesh, self.device, fsdp=self.fsdp)

    def _build_optimizer(self) -> None:
        from transformers import get_cosine_schedule_with_warmup

        optim = self.cfg.optim
        if optim.lr_scheduler != "cosine":
            raise ValueError(f"optim.lr_scheduler={optim.lr_scheduler!r}: only cosine is implemented")
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        warmup = int(optim.warmup_steps_ratio * self.total_steps)
        self.scheduler = get_cosine_schedule_with_warmup(self.optimizer, warmup, self.total_steps)

    def _maybe_resume(self) -> int:
        """Load the newest resumable checkpoint of a run with the same identity; returns its step (0 if none)."""
        step = checkpoints.latest_step(self.out_dir)
        if step is None:
            return 0
        self._load_checkpoint(checkpoints.step_dir(self.out_dir, step))
        return self.global_step

    def _load_checkpoint(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state_dir = path / checkpoints.TRAIN_STATE
        options = StateDictOptions(full_state_dict=True, strict=False)
        if self.lora_scale is None:
            from safetensors.torch import load_file

            weights = {}
            for shard_file in sorted(path.glob("*.safetensors")):
                weights.update(load_file(shard_file))
        else:
            weights = torch.load(state_dir / "adapter.pt", weights_only=True)
        set_model_state_dict(self.model, weights, options=options)
        optim_state = torch.load(state_dir / "optimizer.pt", weights_only=False)
        set_optimizer_state_dict(self.model, self.optimizer, optim_state, options=options)
        self.scheduler.load_state_dict(torch.load(state_dir / "scheduler.pt", weights_only=True))
        rng_file = state_dir / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            torch.set_rng_state(torch.load(rng_file, weights_only=True))
        self.global_step = checkpoints.read_train_state(path)["global_step"]
        if self.rank == 0:
            print(f"resumed from {path} (step {self.global_step})", flush=True)

    # ---------------------------------------------------------------- training
    def epoch_order(self, epoch: int) -> list[int]:
        """The shuffled row order of an epoch (same on every rank, from trainer.seed and the epoch)."""
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.train_data), generator=generator).tolist()

    def train(self, stop_at_step: int | None = None) -> None:
        """Run until `total_steps` (or `stop_at_step`, to simulate an interrupted run)."""
        last = min(self.total_steps, stop_at_step or self.total_steps)
        bar = progress_bar(total=self.total_steps, initial=self.global_step, disable=self.rank != 0, desc="sft",
                           dynamic_ncols=True)
        size = self.cfg.data.train_batch_size
        while self.global_step < last:
            epoch, index = divmod(self.global_step, self.steps_per_epoch)
            order = self.epoch_order(epoch)
            self.heartbeat.doing(f"sft: step {self.global_step + 1}/{self.total_steps} running")
            metrics = self.train_step(order[index * size:(index + 1) * size])
            self.global_step += 1
            end_of_epoch = self.global_step % self.steps_per_epoch == 0 or self.global_step == self.total_steps
            if end_of_epoch and self.val_data is not None:
                self.heartbeat.doing(f"sft: validation after step {self.global_step} running")
                start = time.perf_counter()
                metrics["val/loss"] = self.validate()
                metrics["val/seconds"] = time.perf_counter() - start
            self._log(metrics | {"train/epoch": epoch + (index + 1) / self.steps_per_epoch}, bar)
            self.heartbeat.mark()
            freq = self.cfg.trainer.save_freq
            if end_of_epoch or (freq and freq > 0 and self.global_step % freq == 0):
                self.heartbeat.doing(f"sft: saving global_step_{self.global_step}")
                start = time.perf_counter()
                saved = self.save_checkpoint(end_of_epoch)
                if self.rank == 0:
                    tqdm.write(f"saved {saved.name} ({time.perf_counter() - start:.1f} s)")
        bar.close()

    def _collate(self, indices: list[int], dataset: SpaSftDataset) -> dict[str, torch.Tensor]:
        samples = [dataset[i] for i in indices]
        data = self.cfg.data
        if data.packing:
            return collate_packed(samples, self.pad_id, data.pad_packed_to_multiple)
        return collate_padded(samples, self.pad_id)

    def _plan(self, indices: list[int], dataset: SpaSftDataset) -> list[list[list[int]]]:
        data = self.cfg.data
        if data.packing:
            return plan_packed(indices, dataset.lengths, self.world_size, data.max_tokens_per_micro_batch)
        return plan_padded(indices, dataset.lengths, self.world_size, data.micro_batch_size_per_gpu)

    def train_step(self, indices: list[int]) -> dict[str, float]:
        """One optimizer step on the global batch `indices`; returns the step's metrics."""
        start = time.perf_counter()
        self.model.train()  # from_pretrained leaves eval mode, in which gradient checkpointing never recomputes
        plan = self._plan(indices, self.train_data)
        batches = [[self._collate(m, self.train_data) for m in rank_plan] for rank_plan in plan]
        n_loss = sum(count_loss_tokens(b) for rank_batches in batches for b in rank_batches)
        # FSDP averages gradients over ranks; world_size / n_loss makes the result sum(loss) / n_loss.
        scale = self.world_size / max(n_loss, 1)
        loss_sum = torch.zeros((), device=self.device)
        for batch in batches[self.rank]:
            with self.compute():
                loss = self.loss_sum(self.model, {k: v.to(self.device) for k, v in batch.items()})
            (loss * scale).backward()
            loss_sum += loss.detach()
        all_reduce(loss_sum)
        lr = self.scheduler.get_last_lr()[0]
        grad_norm, loss_sum = self._clip_and_step(loss_sum)
        real = sum(len(self.train_data[i]) for i in indices)
        slots = sum(b["input_ids"].numel() for rank_batches in batches for b in rank_batches)
        elapsed = time.perf_counter() - start
        return {"train/loss": loss_sum / max(n_loss, 1), "train/lr": lr,
                "train/grad_norm": grad_norm, "train/tokens_per_s": real / elapsed,
                "train/useful_token_fraction": real / slots, "train/loss_tokens": float(n_loss),
                "train/step_s": elapsed}

    def _clip_and_step(self, loss_sum: torch.Tensor) -> tuple[float, float]:
        """Clip to optim.clip_grad, step unless the norm is not finite (spec §9.2), advance the schedule. Returns the
        gradient norm and `loss_sum` (a scalar on the device), read to the host together, before the optimizer
        step: the step's one wait for the device, whose optimizer kernels then run while the host goes on."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.clip_grad)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        # float64 holds any float32/bf16 value exactly: the same Python floats as float(norm) and loss_sum.item()
        norm, loss_sum = torch.stack([norm.double(), loss_sum.double()]).tolist()
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm, loss_sum

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss over the whole validation set (all ranks)."""
        self.model.eval()
        indices = list(range(len(self.val_data)))
        plan = self._plan(indices, self.val_data)
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)
        for micro in plan[self.rank]:
            batch = self._collate(micro, self.val_data)
            with self.compute():
                totals[0] += self.loss_sum(self.model, {k: v.to(self.device) for k, v in batch.items()}).double()
            totals[1] += count_loss_tokens(batch)
        all_reduce(totals)
        return (totals[0] / totals[1].clamp(min=1)).item()

    def _log(self, metrics: dict[str, float], bar: tqdm) -> None:
        if self.rank != 0:
            return
        self.metrics.log(metrics, self.global_step)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", lr=f"{metrics['train/lr']:.2e}",
                        tok_s=f"{metrics['train/tokens_per_s']:.0f}")
        if bar.disable:  # no terminal: one plain line per step for the log file
            print(f"step {self.global_step}/{self.total_steps}: loss {metrics['train/loss']:.4f} "
                  f"lr {metrics['train/lr']:.2e} ({metrics['train/step_s']:.2f} s)", flush=True)
        if "val/loss" in metrics:
            tqdm.write(f"step {self.global_step}: val/loss {metrics['val/loss']:.4f} ({metrics['val/seconds']:.1f} s)")

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, end_of_epoch: bool) -> Path:
        """Write `global_step_N/` (HF model + tokenizer + train_state/) atomically; prune old ones."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        staging = checkpoints.staging_dir(self.out_dir, self.global_step)
        state = full_state_dict(self.model)
        optim_state = get_optimizer_state_dict(self.model, self.optimizer,
                                               options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            checkpoints.stage(self.out_dir, self.global_step)
            self._save_hf(staging, state)
            state_dir = staging / checkpoints.TRAIN_STATE
            state_dir.mkdir(exist_ok=True)
            torch.save(optim_state, state_dir / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), state_dir / "scheduler.pt")
            if self.lora_scale is not None:
                torch.save(trainable_state_dict(self.model, state), state_dir / "adapter.pt")
        barrier()
        torch.save(torch.get_rng_state(), staging / checkpoints.TRAIN_STATE / f"rng_rank{self.rank}.pt")
        barrier()
        final = checkpoints.step_dir(self.out_dir, self.global_step)
        if self.rank == 0:
            epoch, index = divmod(self.global_step, self.steps_per_epoch)
            checkpoints.write_train_state(staging, {
                "global_step": self.global_step, "epoch": epoch, "step_in_epoch": index,
                "end_of_epoch": end_of_epoch, "total_steps": self.total_steps})
            # older checkpoints lose their training state; their weights stay only if they closed an epoch
            keep = {checkpoints.TRAIN_STATE: self.cfg.trainer.max_ckpt_to_keep}
            checkpoints.commit(self.out_dir, self.global_step, keep, keep_rest=checkpoints.closed_an_epoch)
        barrier()
        return final

    def _save_hf(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        model = self.model.get_base_model() if self.lora_scale is not None else self.model
        model.save_pretrained(directory, state_dict=merged_hf_state_dict(state, self.lora_scale))
        self.tokenizer.save_pretrained(directory)

    def interrupted(self, preflight: bool) -> str:
        """The Ctrl-C line: what was kept and how to continue."""
        if preflight:
            return "nothing was written (only the checks ran); run the same command again"
        saved = checkpoints.saved(self.out_dir)
        if not saved:
            return f"no checkpoint was saved yet in {self.out_dir}; run the same command again"
        return (f"the checkpoints saved so far are in {self.out_dir} (latest {saved[-1][1].name}); the same command "
                "with trainer.resume=auto (RESUME=1 in finetune_ft.sh) continues from the latest")

    def cleanup(self) -> None:
        self.heartbeat.stop()
        self.process_settings.close()
        if self.rank == 0 and hasattr(self, "metrics"):
            self.metrics.close()
        if self.lock is not None:
            self.lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


@hydra_entry(Path(__file__).resolve().parent / "config", config_name="sft_trainer")
def main(cfg: DictConfig) -> None:
    """Entry point: reads torchrun's RANK/WORLD_SIZE/LOCAL_RANK; user errors exit with status 2. With
    trainer.log_file (sft/finetune_ft.sh with one rank, no torchrun), this one process runs the preflight's checks,
    then takes the output directory's lock, copies its output to the log from there on, and trains."""
    die_with_launcher()
    if HOLDER_ENV in os.environ:  # sft/finetune_ft.sh took the output directory's lock for this run
        adopt_locks_of(int(os.environ[HOLDER_ENV]))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    init_method = "env://" if "MASTER_ADDR" in os.environ else None
    with open_dict(cfg):
        cfg.trainer.wandb_mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    preflight, log_file = cfg.trainer.get("preflight_nproc"), cfg.trainer.get("log_file")
    use_persistent_compile_cache()
    quiet_library_progress()
    trainer = SftTrainer(cfg, rank, preflight or world, local_rank, init_method)
    checking = bool(preflight or log_file)  # nothing written yet: only the checks ran
    try:
        if checking:
            trainer.preflight()
        if preflight:
            return
        if log_file:
            trainer.lock_output_dir()
            checking = False
            tee_this_process(Path(log_file), append=cfg.trainer.resume == "auto")
        trainer.setup()
        trainer.train()
    except KeyboardInterrupt:  # Ctrl-C; under torchrun, the launcher forwards it to every rank (sft/launch.py)
        if rank == 0:
            print(f"interrupted: {trainer.interrupted(checking)}", file=sys.stderr, flush=True)
        trainer.cleanup()
        sys.exit(EXIT_INTERRUPTED)
    except (ValueError, FileNotFoundError) as error:
        # Every rank says why: an error that only another rank meets is otherwise lost when torchrun stops rank 0.
        print(f"error{f' (rank {rank})' if rank else ''}: {error}", file=sys.stderr, flush=True)
        trainer.cleanup()
        sys.exit(2)
    trainer.cleanup()


if __name__ == "__main__":
    main()

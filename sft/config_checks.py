"""Checks of a composed SFT config before any data, model or process group (sft/config/sft_trainer.yaml): each
value the trainer computes with has the right type and range, in one line naming the key. Light (no torch), so
that the pipeline scripts can check the SFT settings before stage 1 starts (SPA_agent/pipeline_check.py)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from sft.loss_targets import LossTarget
from SPA_agent.entry import check_list, check_number, check_numbers

#: `(key, low, high, integer)` of every number the trainer reads (null skipped where the config allows it)
NUMBERS = (
    ("data.train_batch_size", 1, None, True), ("data.micro_batch_size_per_gpu", 1, None, True),
    ("data.max_length", 1, None, True), ("data.max_tokens_per_micro_batch", 1, None, True),
    ("optim.lr", 0, None, False), ("optim.weight_decay", 0, None, False), ("optim.warmup_steps_ratio", 0, 1, False),
    ("optim.clip_grad", 0, None, False), ("model.lora_rank", 0, None, True), ("model.lora_alpha", 0, None, False),
    ("trainer.total_epochs", 1, None, True), ("trainer.max_ckpt_to_keep", 1, None, True),
    ("trainer.seed", 0, None, True), ("trainer.preflight_nproc", 1, None, True),
)
TRUNCATIONS = ("left", "right", "error")


def check_sft_config(cfg: DictConfig, world_size: int = 1) -> None:
    """Raise ValueError naming the key of the first setting the SFT trainer cannot run with on `world_size` ranks
    (the data-dependent checks, rows against the batch size, come when the data is read)."""
    check_numbers(cfg, NUMBERS)
    data = cfg.data
    for key in ("data.packing", "data.require_data_card", "model.enable_gradient_checkpointing",
                "trainer.deterministic"):
        if not isinstance(value := OmegaConf.select(cfg, key), bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
    if (liger := cfg.model.use_liger) not in (True, False, "auto"):
        raise ValueError(f"model.use_liger must be true, false or auto, got {liger!r}")
    if data.pad_packed_to_multiple != "auto":
        check_number(cfg, "data.pad_packed_to_multiple", 0, integer=True)
    if data.truncation not in TRUNCATIONS:
        raise ValueError(f"data.truncation={data.truncation!r} is not one of {list(TRUNCATIONS)}")
    LossTarget.parse(data.loss_target)
    if len(check_list(cfg, "optim.betas", float, "[0.9,0.95]")) != 2:
        raise ValueError(f"optim.betas must hold two numbers, got {list(cfg.optim.betas)}")
    check_list(cfg, "trainer.logger", str, "['console']")
    fsdp = OmegaConf.select(cfg, "trainer.fsdp", default="auto")
    if fsdp not in ("auto", True, False):
        raise ValueError(f"trainer.fsdp must be auto, true or false, got {fsdp!r}")
    if fsdp is False and world_size > 1:
        raise ValueError(f"trainer.fsdp=false trains one rank only, got {world_size} ranks (use auto or true)")
    preflight = OmegaConf.select(cfg, "trainer.preflight_nproc")
    if OmegaConf.select(cfg, "trainer.log_file") is not None and (preflight is not None or world_size > 1):
        raise ValueError("trainer.log_file checks and then trains in one process, without torchrun; got "
                         + (f"trainer.preflight_nproc={preflight} (only checks)" if preflight is not None
                            else f"{world_size} ranks"))
    check_batch_sizes(cfg, world_size)


def check_batch_sizes(cfg: DictConfig, world_size: int) -> None:
    """The global batch splits evenly over the ranks, and a packed micro-batch holds the longest row."""
    data = cfg.data
    per_rank_unit = world_size * (1 if data.packing else data.micro_batch_size_per_gpu)
    if data.train_batch_size % per_rank_unit:
        what = "ranks" if data.packing else "ranks × data.micro_batch_size_per_gpu"
        raise ValueError(f"data.train_batch_size={data.train_batch_size} is not divisible by {what} = "
                         f"{per_rank_unit}")
    if data.packing and data.max_tokens_per_micro_batch < data.max_length:
        raise ValueError(f"data.max_tokens_per_micro_batch={data.max_tokens_per_micro_batch} must be >= "
                         f"data.max_length={data.max_length}")

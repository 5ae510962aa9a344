"""CPU sweeps behind the `small` preset's settings (docs/small_model.md). Not a test: a script that prints tables.

    python benchmarks/small_model_sweep.py sft --out sweep      # SFT learning rates on Sokoban self-play data
    python benchmarks/small_model_sweep.py ppo --out sweep      # PPO actor learning rates on the bandit

`sft`: random-generator Sokoban data in add_worldmodel mode (what `run_spa.sh` makes for a from-scratch model),
then `--sft-steps` SFT steps of the small model per learning rate (loss_target=paper, `--sft-batch` rows); reports the mean
train loss of the last 5 steps and the validation loss. `ppo`: the learning test's bandit pipeline
(config/_bandit.yaml) with the small model: one SFT, then PPO per actor learning rate; reports validation
success before and after, and the actor entropy of the last step. Runs on `--device` (cpu by default), one torch thread.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sft import in_process as sft
from SPA_agent.config import compose
from SPA_agent.runs.metrics_logger import read_metrics
from SPA_agent.selfplay.generate import generate, prepare_data_gen_config
from SPA_agent.trainer.main_ppo import run

MODEL = "small"


def make_data(config: str, out: Path, overrides: list[str]) -> Path:
    cfg = compose(config, [f"model={MODEL}", f"data_gen.output_dir={out}", *overrides])
    generate(prepare_data_gen_config(cfg, config))
    return out


def sft_run(data: Path, out: Path, device: str, overrides: list[str]) -> tuple[Path, list[dict]]:
    checkpoint = sft.train_on(data, out, MODEL, [f"trainer.device={device}", *overrides])
    return checkpoint, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def sweep_sft(args) -> list[dict]:
    data = make_data("_2_sokoban", args.out / "sokoban-data", [
        "generator=random", "data_gen.num_batches=1", "es_manager.train.env_groups=8",
        "es_manager.train.env_configs.n_groups=[8]", "es_manager.train.group_size=4", "data_gen.write_trajectories=false"])
    rows = []
    for lr in args.lrs:
        _, records = sft_run(data, args.out / f"sft-lr{lr}", args.device, [
            f"optim.lr={lr}", f"data.train_batch_size={args.sft_batch}", f"trainer.total_training_steps={args.sft_steps}",
            "trainer.total_epochs=100", "data.max_length=2048", "data.max_tokens_per_micro_batch=4096",
            f"trainer.save_freq={args.sft_steps}"])
        train = [r["train/loss"] for r in records if "train/loss" in r]
        val = [r["val/loss"] for r in records if "val/loss" in r]
        rows.append({"lr": lr, "first_loss": train[0], "last5_loss": sum(train[-5:]) / len(train[-5:]),
                     "val_loss": val[-1] if val else None})
        print(rows[-1], flush=True)
    return rows


def sweep_ppo(args) -> list[dict]:
    base = compose("_bandit")
    data = make_data("_bandit", args.out / "bandit-data", list(base.learning_test.data_gen_overrides))
    sft_overrides = [o for o in base.learning_test.sft_overrides if not o.startswith("optim.lr=")]
    checkpoint, _ = sft_run(data, args.out / "bandit-sft", args.device, [*sft_overrides, f"optim.lr={args.bandit_sft_lr}"])
    rows = []
    for lr in args.lrs:
        cfg = compose("_bandit", [f"model_path={checkpoint}", f"actor_rollout_ref.actor.optim.lr={lr}",
                                  f"critic.optim.lr={lr * 10}", f"trainer.default_local_dir={args.out / f'ppo-lr{lr}'}",
                                  f"trainer.device={args.device}", "generator.progress=False"])
        records = read_metrics(run(cfg) / "metrics.jsonl")
        curve = {r["step"]: r["val-env/Bandit/success"] for r in records if "val-env/Bandit/success" in r}
        rows.append({"actor_lr": lr, "critic_lr": lr * 10, "val_success": curve,
                     "entropy_last": records[-1].get("actor/entropy")})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["sft", "ppo"])
    parser.add_argument("--out", type=Path, required=True, help="working directory (data, checkpoints, results)")
    parser.add_argument("--lrs", type=float, nargs="+", help="learning rates to sweep")
    parser.add_argument("--sft-steps", type=int, default=25, help="SFT steps per learning rate (sft stage)")
    parser.add_argument("--sft-batch", type=int, default=4, help="SFT rows per optimizer step (sft stage)")
    parser.add_argument("--bandit-sft-lr", type=float, default=1e-3, help="SFT learning rate of the ppo stage")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    args = parser.parse_args()
    args.lrs = args.lrs or ([1e-4, 5e-4, 2e-3] if args.stage == "sft" else [1e-5, 1e-4, 1e-3])
    torch.set_num_threads(1)
    rows = sweep_sft(args) if args.stage == "sft" else sweep_ppo(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stage}_sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

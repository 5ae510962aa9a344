"""The model presets: where `model=<preset>` / `model_path=<name>` becomes a model directory, and the scripts'
model-size table (`MODEL=1.5B` → preset `qwen2.5-1.5b`, its SFT settings and CPU-sized defaults).

`resolve_model_path` maps the named models to directories: `tiny` and `small` to the embedded models that
SPA_agent/tiny.py builds offline, `smollm2-135m` to the SmolLM2 conversion of SPA_agent/smollm2.py; any other
hub id or local path passes through.

`SCRIPT_MODELS` is the one table of the bash scripts' `MODEL` names. Each row names its Hydra preset
(config/model/<preset>.yaml) and holds what only the scripts read; the `MODEL` name itself (`model_size`) and the
model the SFT stage starts from (`model_path`) are read from that preset file, so nothing is written twice. The
scripts ask this module (scripts/common.sh `model_settings`, sft/finetune_ft.sh):

    python -m SPA_agent.model_presets shell 1.5B          # MODEL_PRESET=qwen2.5-1.5b, MODEL_FAMILY=qwen, ...
    python -m SPA_agent.model_presets lookup 1.5B preset  # one field: qwen2.5-1.5b
An unknown name is one line on stderr (`error: unknown MODEL '7B'; choose one of ...`) and exit status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from SPA_agent import smollm2
from SPA_agent.tiny import EMBEDDED_MODELS, embedded_model_dir

MODEL_DIR = Path(__file__).resolve().parents[1] / "config" / "model"

#: `model_path` names resolved to a built or converted directory (the rest are hub ids or local paths)
NAMED_MODELS = (*EMBEDDED_MODELS, smollm2.NAME)


def resolve_model_path(model_path: str, cache_dir: str | Path | None = None) -> str:
    """Map `tiny` / `small` to the embedded model's directory and `smollm2-135m` to the converted SmolLM2
    (SPA_agent/smollm2.py); any other Hub id or local path passes through."""
    if str(model_path) in EMBEDDED_MODELS:
        return str(embedded_model_dir(str(model_path), cache_dir))
    if str(model_path) == smollm2.NAME:
        return str(smollm2.smollm2_model_dir(cache_dir))
    return str(model_path)


@dataclass(frozen=True)
class ScriptModel:
    """One `MODEL` of the bash scripts: its Hydra preset and the settings only the scripts read."""

    #: config/model/<preset>.yaml (its `model_size` is the script's MODEL name, its `model_path` the SFT start)
    preset: str
    #: short family name in SFT checkpoint directory names (run_spa.sh CHECKPOINT_DIR)
    family: str
    #: family in the SFT trainer's experiment name (`<env>-sft-<sft_family>-<MODEL>-instruct`)
    sft_family: str
    #: SFT `data.max_length`: the paper's 2048 (spec §2.4); longer rows lose the start of their prompt (counted in
    #: <save_path>/truncation.json). The embedded byte-level tokenizer writes more tokens per row: its self-play
    #: rows measure up to 1998 (Sokoban), 1939 (FrozenLake) and 2473 (Sudoku) tokens. SmolLM2's Sokoban self-play
    #: rows measure up to 1,768 tokens.
    sft_max_length: int = 2048
    #: run_spa.sh's SFT overrides for this model, before the experiment's and SFT_OVERRIDES
    sft_defaults: str = ""
    #: run_spa.sh's data generator when neither GENERATOR nor the experiment sets one ("": vllm when installed,
    #: else hf)
    data_generator: str = ""
    #: run_spa.sh's BT_NUM default (rollout batches of self-play data)
    data_batches: int = 5
    #: train_ppo_sfted.sh's TOTAL_STEPS default
    ppo_steps: int = 1000
    #: whether the paper reports this model (the summary puts the paper's rows beside ours)
    in_paper: bool = True

    def model_size(self) -> str:
        """The script's MODEL name: the preset file's `model_size`."""
        return str(_preset_file(self.preset)["model_size"])

    def sft_model(self) -> str:
        """The model the SFT stage starts from: the preset file's `model_path`."""
        return str(_preset_file(self.preset)["model_path"])


#: the scripts' MODEL names, in the order the error message lists them
SCRIPT_MODELS = (
    ScriptModel("qwen2.5-0.5b", family="qwen", sft_family="qwen-2.5"),
    ScriptModel("qwen2.5-1.5b", family="qwen", sft_family="qwen-2.5"),
    ScriptModel("qwen2.5-3b", family="qwen", sft_family="qwen-2.5"),
    ScriptModel("llama3.2-1b", family="llama", sft_family="llama-3.2"),
    # CPU-sized: 2 data batches, 3 SFT epochs at lr 1e-3, 2 PPO steps
    ScriptModel("tiny", family="tiny", sft_family="tiny", sft_max_length=4096, data_generator="random",
                data_batches=2, ppo_steps=2, in_paper=False,
                sft_defaults="optim.lr=1e-3 trainer.total_epochs=3 data.max_tokens_per_micro_batch=4096"),
    # from scratch: the SFT settings of docs/small_model.md
    ScriptModel("small", family="small", sft_family="small", sft_max_length=4096, data_generator="random",
                in_paper=False, sft_defaults="optim.lr=5e-4 trainer.total_epochs=2"),
    # its own self-play writes no state blocks (docs/smollm2.md): the random-action data of the paper's Table 5,
    # 2 SFT epochs at the paper's lr; packed attention without flex attention's compilation (210 s on a fresh
    # H100, more than the epoch's steps); Liger's kernels where they run (the host-bound step 0.24 -> 0.20 s, H200).
    # One packed micro-batch a step (issue 42: the step is bound by kernel launches, and a step of 16 rows, ~19k
    # tokens, 14.6-23.2k in an epoch of the random-action data, ran as two micro-batches of the default 16,384): the
    # budget 32,768 = max_length 2048 x 16 rows holds any step whole; the same loss and gradients, only summed in
    # one backward (tests/sft/test_sft_trainer.py). Memory grows with the step's tokens, not the budget: ~1.0 MiB of
    # saved activations a token (hidden 576, MLP 1536, 30 layers, float32 residual stream under bf16 autocast;
    # 18.1 GiB peak at a ~16k-token micro-batch on an H200 without Liger, 13.1 GiB with it, weights + AdamW 2 GiB).
    # Logits (vocabulary 49,152) are computed only at the trained positions (~13% of the tokens: ~0.8 GB in float32
    # for a full 32k step, not 6.4 GB), and not kept at all by Liger's fused loss. Peak of a full 32,768-token step
    # ~34 GiB without Liger, ~24 GiB with it; of the data's largest step (23.2k) ~25 / ~18 GiB.
    ScriptModel("smollm2-135m", family="smollm2", sft_family="smollm2", data_generator="random", in_paper=False,
                sft_defaults="trainer.total_epochs=2 model.attn_implementation=packed_sdpa model.use_liger=auto "
                             "data.max_tokens_per_micro_batch=32768"),
)

#: the fields the scripts read; `sft_model` is the preset file's `model_path`
FIELDS = ("preset", "family", "sft_model", "sft_family", "sft_max_length", "sft_defaults", "data_generator",
          "data_batches", "ppo_steps", "in_paper")


def _preset_file(preset: str) -> dict:
    import yaml

    with open(MODEL_DIR / f"{preset}.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def script_models() -> dict[str, ScriptModel]:
    """MODEL name → its row, in table order."""
    return {model.model_size(): model for model in SCRIPT_MODELS}


class UnknownModelError(ValueError):
    pass


def script_model(name: str, label: str = "MODEL") -> ScriptModel:
    models = script_models()
    if name not in models:
        raise UnknownModelError(f"unknown {label} '{name}'; choose one of {', '.join(models)}")
    return models[name]


def field(model: ScriptModel, name: str) -> str:
    """A field as the shell reads it: booleans as 1 / empty."""
    value = model.sft_model() if name == "sft_model" else getattr(model, name)
    if isinstance(value, bool):
        return "1" if value else ""
    return str(value)


def shell_assignments(model: ScriptModel) -> str:
    """`MODEL_<FIELD>=value` lines for `eval`, plus NAMED_MODELS (the names resolve_model_path builds)."""
    lines = [f"MODEL_{name.upper()}={shlex.quote(field(model, name))}" for name in FIELDS]
    lines.append(f"NAMED_MODELS={shlex.quote(' '.join(NAMED_MODELS))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m SPA_agent.model_presets",
                                     description="The scripts' model-size table (MODEL name → preset, settings).")
    parser.add_argument("--label", default="MODEL", help="what the name is called in the error message")
    sub = parser.add_subparsers(dest="command", required=True)
    shell = sub.add_parser("shell", help="print shell assignments MODEL_<FIELD>=... for a MODEL name")
    shell.add_argument("model")
    lookup = sub.add_parser("lookup", help="print one field of a MODEL name")
    lookup.add_argument("model")
    lookup.add_argument("field", choices=FIELDS)
    sub.add_parser("list", help="print the MODEL names, one a line")
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(script_models()))
        return 0
    try:
        model = script_model(args.model, args.label)
    except UnknownModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(shell_assignments(model) if args.command == "shell" else field(model, args.field))
    return 0


if __name__ == "__main__":
    sys.exit(main())

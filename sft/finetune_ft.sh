#!/usr/bin/env bash
# Stage 2 (world-model SFT, spec §2.4): torchrun over <nproc_per_node> ranks (GPUs with NCCL, or CPU processes
# with gloo when CUDA is absent), the paper's recipe, extra Hydra overrides last.
#   bash sft/finetune_ft.sh sokoban 4 sftckpt/checkpoints_2_sokoban-1.5B sftdata/_2_sokoban 1.5B
#   bash sft/finetune_ft.sh sokoban 1 /tmp/sft-tiny sftdata/tiny tiny trainer.total_epochs=1
# A run starts fresh in <save_path>; RESUME=1 continues a run there with the same settings, data and model.
set -euo pipefail

usage() {
    echo "usage: $0 <env_type> <nproc_per_node> <save_path> <data_path> <model_size: a MODEL name (python -m SPA_agent.model_presets list)> [hydra overrides...]" >&2
    echo "  <data_path> must hold wm_train.parquet and wm_val.parquet (stage 1 output)" >&2
    exit 2
}
[[ $# -lt 5 ]] && usage

env_type=$1
nproc_per_node=$2
save_path=$3
data_path=$4
model_size=$5
shift 5

python=${PYTHON:-python}
# This repository's code whatever the directory (as scripts/common.sh).
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
# The model-size table (SPA_agent/model_presets.py): the model SFT starts from, its family in the experiment name,
# and data.max_length (the paper's 2048, spec §2.4; 4096 for the embedded byte-level tokenizer's longer rows).
settings="$("$python" -m SPA_agent.model_presets --label "model size" shell "$model_size")" || exit 2
eval "$settings"
model=$MODEL_SFT_MODEL; family=$MODEL_SFT_FAMILY; max_length=$MODEL_SFT_MAX_LENGTH
if ! [[ "$nproc_per_node" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: nproc_per_node must be a positive integer, got '$nproc_per_node'" >&2
    exit 2
fi
for split in train val; do  # (not yet made when run_spa.sh checks every stage first: SPA_PRINT_STAGE=1)
    if [[ -z "${SPA_PRINT_STAGE:-}" && ! -f "$data_path/wm_$split.parquet" ]]; then
        echo "error: $data_path/wm_$split.parquet not found: run stage 1 first or fix <data_path>" >&2
        exit 2
    fi
done

case "${RESUME:-0}" in
    1|true|True) resume=auto; append_log=1 ;;
    0|false|False) resume=disable ;;
    *) echo "error: RESUME must be 0 (fresh run, the default) or 1 (continue a matching run), got '$RESUME'" >&2; exit 2 ;;
esac

# An <env_type> naming an entry config is checked against the data card: other data is refused.
card_check=()
[[ -f "$(dirname "$0")/../config/$env_type.yaml" ]] && card_check=(data.config_name="$env_type")

if "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        IFS=',' read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
        n_gpus=${#visible[@]}
    else
        n_gpus=$(nvidia-smi --list-gpus | wc -l)
    fi
    if (( nproc_per_node > n_gpus )); then
        echo "error: nproc_per_node=$nproc_per_node but only $n_gpus GPU(s) are visible" >&2
        exit 2
    fi
fi

overrides=(
    data.train_files="$data_path/wm_train.parquet"
    data.val_files="$data_path/wm_val.parquet"
    data.prompt_key=prompt
    data.response_key=response
    data.max_length="$max_length"
    optim.lr=1e-4
    data.train_batch_size=16
    data.micro_batch_size_per_gpu=1
    model.partial_pretrain="$model"
    trainer.default_local_dir="$save_path"
    trainer.experiment_name="${env_type}-sft-${family}-${model_size}-instruct"
    trainer.logger="['console']"
    trainer.total_epochs=5
    trainer.max_ckpt_to_keep=2
    model.target_modules=all-linear
    trainer.project_name=spa-sft
    model.enable_gradient_checkpointing=False
    trainer.resume="$resume"
    "${card_check[@]}"
    "$@"
)
# SPA_PRINT_STAGE=1: print the trainer's arguments instead of training (run_spa.sh checks every stage's settings
# before its first stage, scripts/common.sh check_stages).
if [[ -n "${SPA_PRINT_STAGE:-}" ]]; then
    printf '%s\n' -m sft.spa_sft_trainer "${overrides[@]}" trainer.preflight_nproc="$nproc_per_node"
    exit 0
fi
# Check the config and data in one process first: a user error prints one line and exits with status 2.
"$python" -m sft.spa_sft_trainer "${overrides[@]}" trainer.preflight_nproc="$nproc_per_node"

# The lock of <save_path> is taken before anything is written there, its log included: a second run into the same
# directory stops in one line instead of overwriting this run's train.log (SPA_agent/runs/locked_run.py). sft.launch
# is torchrun, ending on Ctrl-C (or a rank's death) with one line instead of its traceback.
"$python" -m SPA_agent.runs.locked_run --dir "$save_path" --log "$save_path/train.log" ${append_log:+--append} -- \
    "$python" -m sft.launch --standalone --nnodes=1 --nproc_per_node="$nproc_per_node" \
    -m sft.spa_sft_trainer "${overrides[@]}"

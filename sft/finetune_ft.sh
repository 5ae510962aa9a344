#!/usr/bin/env bash
# Stage 2 (world-model SFT, spec §2.4): torchrun over <nproc_per_node> ranks (GPUs with NCCL, or CPU processes
# with gloo when CUDA is absent), or one process without torchrun for one rank; the paper's recipe, extra Hydra
# overrides last.
#   bash sft/finetune_ft.sh sokoban 4 sftckpt/checkpoints_2_sokoban-1.5B sftdata/_2_sokoban 1.5B
#   bash sft/finetune_ft.sh sokoban 1 /tmp/sft-tiny sftdata/tiny tiny trainer.total_epochs=1
# A run starts fresh in <save_path>; RESUME=1 continues a run there with the same settings, data and model.
set -euo pipefail

python=${PYTHON:-python}
# This repository's code whatever the directory (as scripts/common.sh).
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"

usage() {
    local splits
    splits="$("$python" -c 'from SPA_agent.stages import DATA_FILES; print(" and ".join(DATA_FILES))')"
    echo "usage: $0 <env_type> <nproc_per_node> <save_path> <data_path> <model_size: a MODEL name (python -m SPA_agent.model_presets list)> [hydra overrides...]" >&2
    echo "  <data_path> must hold $splits (stage 1 output)" >&2
    exit 2
}
[[ $# -lt 5 ]] && usage

env_type=$1
nproc_per_node=$2
save_path=$3
data_path=$4
model_size=$5
shift 5

case "${RESUME:-0}" in
    1|true|True) resume=auto; append_log=1 ;;
    0|false|False) resume=disable ;;
    *) echo "error: RESUME must be 0 (fresh run, the default) or 1 (continue a matching run), got '$RESUME'" >&2; exit 2 ;;
esac

# The stage's command from the stage definition (SPA_agent/stages.py): the paper's recipe with the model-size table's
# model, family and data.max_length (the paper's 2048, spec §2.4; 4096 for the embedded byte-level tokenizer's longer
# rows) for <model_size>; an <env_type> naming an entry config is checked against the data card (other data is
# refused). <model_size>, <nproc_per_node> and <data_path> (which must hold stage 1's splits; not yet made when
# run_spa.sh checks every stage first: SPA_PRINT_STAGE=1) are checked there, each in one line.
check_data=(--check-data); [[ -n "${SPA_PRINT_STAGE:-}" ]] && check_data=()
stage="$("$python" -m SPA_agent.stages sft --env-type="$env_type" --nproc="$nproc_per_node" --save-dir="$save_path" \
    --data-dir="$data_path" --model-size="$model_size" --resume="$resume" "${check_data[@]}" -- "$@")" || exit 2
mapfile -t stage_args <<< "$stage"

# One rank fits any machine with CUDA: the check (a Python start with torch) runs for several only.
if (( nproc_per_node > 1 )) && "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
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

# SPA_PRINT_STAGE=1: print the trainer's arguments instead of training (run_spa.sh checks every stage's settings
# before its first stage, scripts/common.sh check_stages).
if [[ -n "${SPA_PRINT_STAGE:-}" ]]; then
    printf '%s\n' "${stage_args[@]}" trainer.preflight_nproc="$nproc_per_node"
    exit 0
fi

# One rank: one process, no torchrun. It checks the config and data as the preflight below does (a user error is one
# line, status 2, nothing written), then takes the lock of <save_path>, copies its output to train.log from there on
# (trainer.log_file, SPA_agent/runs/tee.py) and trains on the data it checked: one start of Python with torch instead
# of four, no reload of the data (benchmarks/RESULTS.md, "SFT start-up on CPU"). Ctrl-C is its own one line and
# status 130; killed by signal n, it ends with status 128 + n and, as sft.launch says of a rank, one line.
if (( nproc_per_node == 1 )); then
    status=0
    # (stderr is the trainer's only: bash's own report of a killed command, "line N: PID Killed ...", is not)
    { "$python" -u "${stage_args[@]}" trainer.log_file="$save_path/train.log" 2>&3 3>&-; } 3>&2 2>/dev/null \
        || status=$?
    if (( status > 128 && status != 130 )); then
        line="$("$python" -c 'import sys; from sft.launch import killed_line; print(killed_line("SFT", int(sys.argv[1])))' \
            "$((status - 128))")"
        echo "$line" >&2
        [[ -f "$save_path/train.log" ]] && echo "$line" >> "$save_path/train.log"
    fi
    exit "$status"
fi
# Check the config and data in one process first: a user error prints one line and exits with status 2. The data it
# tokenizes goes to the ranks through a temporary directory (sft/spa_sft_dataset.py, tokenized_dataset), removed on
# exit: nobody tokenizes it again.
SPA_SFT_TOKENIZED="$(mktemp -d)"
export SPA_SFT_TOKENIZED
trap 'rm -rf "$SPA_SFT_TOKENIZED"' EXIT
"$python" "${stage_args[@]}" trainer.preflight_nproc="$nproc_per_node"

# The lock of <save_path> is taken before anything is written there, its log included: a second run into the same
# directory stops in one line instead of overwriting this run's train.log (SPA_agent/runs/locked_run.py). sft.launch
# is torchrun, ending on Ctrl-C (or a rank's death) with one line instead of its traceback.
"$python" -m SPA_agent.runs.locked_run --dir "$save_path" --log "$save_path/train.log" ${append_log:+--append} -- \
    "$python" -m sft.launch --standalone --nnodes=1 --nproc_per_node="$nproc_per_node" \
    "${stage_args[@]}"

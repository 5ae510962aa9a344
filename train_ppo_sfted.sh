#!/usr/bin/env bash
# PPO (stage 3) from a checkpoint: an SFT checkpoint for SPA, the instruct model for the baseline.
#
#   bash train_ppo_sfted.sh <config> <checkpoint path | hub id | tiny> <experiment name> [hydra overrides...]
# Environment: MODEL (1.5B; 0.5B, 3B, llama1B, tiny: selects CPU-sized settings, small, smollm2-135m),
#   RENDER_MODE (default: the config's, text_with_coordinates unless an experiment=<name> sets it), NGPUS
#   (detected), BASE_DIR (runs go to $BASE_DIR/<config>/<experiment>, default ./checkpoints), TOTAL_STEPS (1000;
#   2 for tiny), ROLLOUT_TP (GPUs per vLLM engine with more than one GPU; default auto, by model size: one engine
#   per GPU where the model fits one), RESUME (0: start fresh in the run directory, the default; 1: continue a
#   run there with the same settings and starting model).
set -euo pipefail
. "$(dirname "$0")/scripts/common.sh"

[ $# -ge 3 ] || die "usage: bash train_ppo_sfted.sh <config> <checkpoint> <experiment name> [overrides...]"
CONFIG_NAME="$1"; CKPT="$2"; EXPERIMENT_NAME="$3"; shift 3
check_config "$CONFIG_NAME"
check_script_variables
export PYTHONHASHSEED=10000
MODEL="${MODEL:-1.5B}"
BASE_DIR="${BASE_DIR:-./checkpoints}"
NGPUS="$(gpu_count)"
model_settings "$MODEL"
TOTAL_STEPS="${TOTAL_STEPS:-$MODEL_PPO_STEPS}"
RESUME_MODE=disable; is_resume && RESUME_MODE=auto
case "$CKPT" in */*) ;; *) [[ " $NAMED_MODELS " == *" $CKPT "* ]] || [ -d "$CKPT" ] || die "checkpoint '$CKPT' is not a directory" ;; esac
if [ -e "$CKPT" ] && [ ! -f "$CKPT/config.json" ]; then die "'$CKPT' is not a Hugging Face model directory (no config.json)"; fi

# One process for CPU or one GPU (local backend); verl's Ray/FSDP workers with tensor-parallel vLLM beyond
# (SPA_agent/stages.py backend_settings). RENDER_MODE, when set, overrides the config (and an experiment=<name>);
# unset, the config decides.
PPO_STAGE_TEXT="$(stage_command ppo --config="$CONFIG_NAME" --model="$MODEL_PRESET" --model-path="$CKPT" \
    --render-mode="${RENDER_MODE:-}" --ngpus="$NGPUS" --rollout-tp="${ROLLOUT_TP:-auto}" --steps="$TOTAL_STEPS" \
    --name="$EXPERIMENT_NAME" --resume-mode="$RESUME_MODE" --base-dir="$BASE_DIR" -- "$@")"
mapfile -t PPO_STAGE <<< "$PPO_STAGE_TEXT"
run_stage "${PPO_STAGE[@]}"

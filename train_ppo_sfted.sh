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
# RENDER_MODE, when set, overrides the config (and an experiment=<name>); unset, the config decides.
RENDER_ARGS=(); [ -n "${RENDER_MODE:-}" ] && RENDER_ARGS=(render_mode="$RENDER_MODE")
BASE_DIR="${BASE_DIR:-./checkpoints}"
NGPUS="$(gpu_count)"
model_settings "$MODEL"
TOTAL_STEPS="${TOTAL_STEPS:-$MODEL_PPO_STEPS}"
RESUME_MODE=disable; is_resume && RESUME_MODE=auto
case "$CKPT" in */*) ;; *) [[ " $NAMED_MODELS " == *" $CKPT "* ]] || [ -d "$CKPT" ] || die "checkpoint '$CKPT' is not a directory" ;; esac
if [ -e "$CKPT" ] && [ ! -f "$CKPT/config.json" ]; then die "'$CKPT' is not a Hugging Face model directory (no config.json)"; fi

# One process for CPU or one GPU (local backend); verl's Ray/FSDP workers with tensor-parallel vLLM beyond.
BACKEND_ARGS=(trainer.backend=local)
if [ "$NGPUS" -gt 1 ]; then
    BACKEND_ARGS=(trainer.backend=verl actor_rollout_ref.rollout.tensor_model_parallel_size="${ROLLOUT_TP:-auto}")
fi

run_stage -m SPA_agent.trainer.main_ppo --config-name "$CONFIG_NAME" model="$MODEL_PRESET" \
    model_path="$CKPT" "${RENDER_ARGS[@]}" "${BACKEND_ARGS[@]}" \
    trainer.n_gpus_per_node="$(( NGPUS > 0 ? NGPUS : 1 ))" \
    trainer.total_training_steps="$TOTAL_STEPS" trainer.save_freq=100 \
    trainer.experiment_name="$EXPERIMENT_NAME" trainer.resume_mode="$RESUME_MODE" \
    trainer.default_local_dir="$BASE_DIR/$CONFIG_NAME/$EXPERIMENT_NAME" "$@"

#!/usr/bin/env bash
# SPA end to end: self-play data → world-model SFT → PPO from the SFT checkpoint → evaluation summary.
#
#   bash run_spa.sh <config> [ckpt=last] [generate_data=False] [hydra overrides for data generation and PPO...]
#
#   config         _2_sokoban | _3_frozen_lake | _10_sudoku
#   ckpt           SFT checkpoint to start PPO from: `last` (highest global_step_N) or a step number N
#   generate_data  True: run stages 1 and 2 first; False: use an existing SFT checkpoint
# Environment: MODEL (1.5B; 0.5B, 3B, llama1B, tiny, small, smollm2-135m), RENDER_MODE (text_with_coordinates | text),
#   BT_NUM (rollout batches of data, 5), GENERATOR (data generator: vllm when installed, else hf;
#   random for MODEL=tiny), NGPUS (detected), OUTPUT_DIR, CHECKPOINT_DIR, BASE_DIR (PPO runs, ./checkpoints),
#   SFT_OVERRIDES (extra Hydra overrides for the SFT stage, space separated), EVAL_DIR (./evals/<experiment>).
# A named experiment (`experiment=<name>`, `python -m SPA_agent.experiments list`) sets the render mode, MODEL
#   and GENERATOR defaults, SFT overrides and data/SFT directory suffixes; without one, RENDER_MODE=text runs
#   spa_no_state_estimation and the default runs spa. Data of FrozenLake and Sudoku is format-filtered
#   (data_gen.format_filter=false keeps every row).
# RESUME (0: every stage starts fresh in its directory, the default; 1: continue runs with the same settings).
# MODEL=tiny uses CPU-sized settings: 2 data batches of 4 × 2 envs with the random generator, 3 SFT epochs
# at lr 1e-3, 2 PPO steps, and an evaluation on 4 puzzles × 2 samples. MODEL=small (from scratch) plays the
# random generator for its data and uses the SFT settings of docs/small_model.md; so does MODEL=smollm2-135m
# (SmolLM2-135M-Instruct from a package, docs/smollm2.md), with 2 SFT epochs at the paper's lr.
set -euo pipefail
. "$(dirname "$0")/scripts/common.sh"

[ $# -ge 1 ] || die "usage: bash run_spa.sh <config> [ckpt=last] [generate_data=False] [overrides...]"
CONFIG_NAME="$1"; CKPT="${2:-last}"; GENERATE_DATA="${3:-False}"; shift $(( $# < 3 ? $# : 3 ))
check_config "$CONFIG_NAME"
check_script_variables
case "${GENERATE_DATA,,}" in
    true) GENERATE_DATA=True ;;
    false) GENERATE_DATA=False ;;
    *) die "generate_data must be True or False, got '$GENERATE_DATA'" ;;
esac
DATA_RESUME=false; is_resume && DATA_RESUME=true
export PYTHONHASHSEED=10000

load_experiment spa "$CONFIG_NAME" "$@"
# shellcheck disable=SC2086
set -- "$@" $EXP_ARGS
MODEL="${MODEL:-${EXP_MODEL:-1.5B}}"
RENDER_MODE="$EXP_RENDER_MODE"
model_settings "$MODEL"
NGPUS="$(gpu_count)"
# Per-model defaults of the model-size table (SPA_agent/model_presets.py): data batches, data generator (random for
# tiny, small and smollm2-135m; else vllm when installed, else hf), SFT overrides.
BT_NUM="${BT_NUM:-$MODEL_DATA_BATCHES}"
GENERATOR="${GENERATOR:-${EXP_DATA_GENERATOR:-${MODEL_DATA_GENERATOR:-$(default_generator)}}}"
SFT_DEFAULTS="$MODEL_SFT_DEFAULTS"
# SFT overrides, later ones win: CPU-sized defaults, the experiment's, then SFT_OVERRIDES.
SFT_OVERRIDES="$SFT_DEFAULTS $EXP_SFT_OVERRIDES ${SFT_OVERRIDES:-}"
# The folders between the stages (SPA_agent/stages.py): the defaults of OUTPUT_DIR and CHECKPOINT_DIR.
script_names --config="$CONFIG_NAME" --model-size="$MODEL" --render-mode="$RENDER_MODE" --experiment="$EXPERIMENT" \
    --base-dir="${BASE_DIR:-./checkpoints}" --data-suffix="$EXP_DATA_SUFFIX" --sft-suffix="$EXP_SFT_SUFFIX"
OUTPUT_DIR="${OUTPUT_DIR:-$DEFAULT_OUTPUT_DIR}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$DEFAULT_CHECKPOINT_DIR}"
export MODEL RENDER_MODE NGPUS

DATA_STAGE_TEXT="$(stage_command data --config="$CONFIG_NAME" --model="$MODEL_PRESET" --render-mode="$RENDER_MODE" \
    --generator="$GENERATOR" --batches="$BT_NUM" --output-dir="$OUTPUT_DIR" --resume="$DATA_RESUME" -- "$@")"
mapfile -t DATA_STAGE <<< "$DATA_STAGE_TEXT"
# shellcheck disable=SC2086
SFT_STAGE=("$CONFIG_NAME" "$(( NGPUS > 0 ? NGPUS : 1 ))" "$CHECKPOINT_DIR" "$OUTPUT_DIR" "$MODEL" ${SFT_OVERRIDES:-})
USER_EVAL_DIR="${EVAL_DIR:-}"

# sft_checkpoint: the SFT checkpoint PPO starts from (CKPT: last, or a step number).
sft_checkpoint() {
    if [ "$CKPT" = last ] || [ -z "$CKPT" ]; then
        latest_checkpoint "$CHECKPOINT_DIR"
    else
        [ -d "$CHECKPOINT_DIR/global_step_$CKPT" ] || die "no checkpoint '$CHECKPOINT_DIR/global_step_$CKPT'"
        echo "$CHECKPOINT_DIR/global_step_$CKPT"
    fi
}

# ppo_names CKPT_PATH: EXPERIMENT_NAME, RUN_DIR and EVAL_DIR of the PPO run from that checkpoint.
ppo_names() {
    script_names --config="$CONFIG_NAME" --model-size="$MODEL" --render-mode="$RENDER_MODE" \
        --experiment="$EXPERIMENT" --base-dir="${BASE_DIR:-./checkpoints}" --start="$1"
    EVAL_DIR="${USER_EVAL_DIR:-$DEFAULT_EVAL_DIR}"
}

# Every stage's settings are checked before the first stage runs, with the commands the stages will run (the SFT
# checkpoint that stage 2 will make stands in for itself): a bad one is one line, and nothing has run.
CKPT_PATH="$CHECKPOINT_DIR/global_step_${CKPT/last/N}"
[ "$GENERATE_DATA" = True ] || CKPT_PATH="$(sft_checkpoint)"
ppo_names "$CKPT_PATH"
STAGES=()
if [ "$GENERATE_DATA" = True ]; then
    STAGES+=("$(printf '%s\n' "${DATA_STAGE[@]}")" "$(SPA_PRINT_STAGE=1 bash "$SPA_REPO/sft/finetune_ft.sh" "${SFT_STAGE[@]}")")
fi
STAGES+=("$(SPA_PRINT_STAGE=1 bash "$SPA_REPO/train_ppo_sfted.sh" "$CONFIG_NAME" "$CKPT_PATH" "$EXPERIMENT_NAME" "$@")"
         "$(evaluation_args "$CONFIG_NAME" "$CKPT_PATH" "$EVAL_DIR/before_ppo" "$(default_generator)" "$@")")
check_stages "${STAGES[@]}"

if [ "$GENERATE_DATA" = True ]; then
    echo "== stage 1: self-play data ($GENERATOR, $BT_NUM batches) -> $OUTPUT_DIR"
    python "${DATA_STAGE[@]}"
    echo "== stage 2: world-model SFT -> $CHECKPOINT_DIR"
    bash "$SPA_REPO/sft/finetune_ft.sh" "${SFT_STAGE[@]}"
    CKPT_PATH="$(sft_checkpoint)"
    ppo_names "$CKPT_PATH"
fi

echo "== stage 3: PPO from $CKPT_PATH -> $RUN_DIR"
bash "$SPA_REPO/train_ppo_sfted.sh" "$CONFIG_NAME" "$CKPT_PATH" "$EXPERIMENT_NAME" "$@"

evaluate_before_after "$CONFIG_NAME" "$CKPT_PATH" "$RUN_DIR" "$EVAL_DIR" "$@"

cat <<SUMMARY
== done. Outputs:
   self-play data     $OUTPUT_DIR  (data_card.md)
   SFT checkpoints    $CHECKPOINT_DIR  (started PPO from $(basename "$CKPT_PATH"))
SUMMARY
print_ppo_outputs "$RUN_DIR" "$EVAL_DIR"

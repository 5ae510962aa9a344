#!/usr/bin/env bash
# Baselines: the same PPO as SPA, from the untouched instruct model (no self-play data, no SFT). By default the
# paper's "Vanilla RL" (experiment=vanilla_rl: the plain symbol grid, render_mode=text); experiment=
# state_estimation_rl (or RENDER_MODE=text_with_coordinates) is its "State Estimation RL" row.
#
#   bash run_baseline.sh <config> [experiment=<name>] [hydra overrides...]   config: _2_sokoban | _3_frozen_lake | _10_sudoku
# Environment: MODEL (1.5B; 0.5B, 3B, llama1B, tiny, small, smollm2-135m), RENDER_MODE, NGPUS, BASE_DIR, RESUME (see train_ppo_sfted.sh),
#   EVAL_DIR (./evals/<experiment>). Ends like run_spa.sh: the model evaluated before and after PPO, a summary
#   beside the paper's rows, and where everything was written.
set -euo pipefail
. "$(dirname "$0")/scripts/common.sh"

[ $# -ge 1 ] || die "usage: bash run_baseline.sh <config> [overrides...]"
CONFIG_NAME="$1"; shift
check_config "$CONFIG_NAME"
check_script_variables
load_experiment baseline "$CONFIG_NAME" "$@"
# shellcheck disable=SC2086
set -- "$@" $EXP_ARGS
MODEL="${MODEL:-${EXP_MODEL:-1.5B}}"
RENDER_MODE="$EXP_RENDER_MODE"
export MODEL RENDER_MODE
model_settings "$MODEL"
MODEL_PATH="$(python -c "from SPA_agent.config import compose; print(compose('$CONFIG_NAME', ['model=$MODEL_PRESET']).model_path)")"
# EXPERIMENT_NAME, RUN_DIR and the default EVAL_DIR of the PPO run (SPA_agent/stages.py).
script_names --config="$CONFIG_NAME" --model-size="$MODEL" --render-mode="$RENDER_MODE" --experiment="$EXPERIMENT" \
    --base-dir="${BASE_DIR:-./checkpoints}"
EVAL_DIR="${EVAL_DIR:-$DEFAULT_EVAL_DIR}"
# The evaluations' settings are checked with PPO's, before PPO runs (scripts/common.sh check_stages).
check_stages "$(SPA_PRINT_STAGE=1 bash "$SPA_REPO/train_ppo_sfted.sh" "$CONFIG_NAME" "$MODEL_PATH" "$EXPERIMENT_NAME" "$@")" \
    "$(evaluation_args "$CONFIG_NAME" "$MODEL_PATH" "$EVAL_DIR/before_ppo" "$(default_generator)" "$@")"
echo "== PPO from $MODEL_PATH -> $RUN_DIR"
bash "$SPA_REPO/train_ppo_sfted.sh" "$CONFIG_NAME" "$MODEL_PATH" "$EXPERIMENT_NAME" "$@"

evaluate_before_after "$CONFIG_NAME" "$MODEL_PATH" "$RUN_DIR" "$EVAL_DIR" "$@"
echo "== done. Outputs:"
print_ppo_outputs "$RUN_DIR" "$EVAL_DIR"

#!/usr/bin/env bash
# Issue 26 on one GPU: SPA and Vanilla RL for SmolLM2-135M-Instruct on SimpleSokoban, every PPO arm side by side.
#
#   OUT=smollm2_sokoban STEPS=40 bash benchmarks/smollm2_sokoban.sh
#
# Through the user's scripts, with MODEL=smollm2-135m:
#   spa_base  run_spa.sh: random-action self-play data (the model's own writes no state blocks), world-model SFT,
#             then PPO with the original's base prompts (its PPO script overrides the prompt mode to base);
#   vanilla   run_baseline.sh: the same PPO from the base model (plain symbol grid, the paper's Vanilla RL), at once;
#   spa_wm    train_ppo_sfted.sh from the same SFT checkpoint with ctx_manager.mode=add_worldmodel (the prompts the
#             SFT rows were made with; the parser also checks the state blocks), once SFT is done.
# Every PPO run: STEPS steps at actor/critic lr ACTOR_LR/CRITIC_LR, validation on 128 puzzles × VAL_SAMPLES every
# TEST_FREQ steps (step 0 is the start model), checkpoints every TEST_FREQ steps. Logs: $OUT/logs/<arm>.log.
set -euo pipefail
OUT="${OUT:-smollm2_sokoban}"; [[ "$OUT" = /* ]] || OUT="$PWD/$OUT"  # relative to the caller's directory
cd "$(dirname "$0")/.."
STEPS="${STEPS:-40}"; TEST_FREQ="${TEST_FREQ:-10}"; VAL_SAMPLES="${VAL_SAMPLES:-4}"
ACTOR_LR="${ACTOR_LR:-1e-5}"; CRITIC_LR="${CRITIC_LR:-1e-4}"
export MODEL=smollm2-135m
mkdir -p "$OUT/logs"
PPO=(trainer.total_training_steps="$STEPS" trainer.test_freq="$TEST_FREQ" trainer.save_freq="$TEST_FREQ"
     es_manager.val.group_size="$VAL_SAMPLES" actor_rollout_ref.actor.optim.lr="$ACTOR_LR" critic.optim.lr="$CRITIC_LR")

python -m SPA_agent.smollm2 > "$OUT/logs/convert.log" 2>&1  # once, before the arms share the cache

BASE_DIR="$OUT/ppo" EVAL_DIR="$OUT/eval/vanilla" bash run_baseline.sh _2_sokoban "${PPO[@]}" \
    > "$OUT/logs/vanilla.log" 2>&1 &
OUTPUT_DIR="$OUT/data" CHECKPOINT_DIR="$OUT/sft" BASE_DIR="$OUT/ppo" EVAL_DIR="$OUT/eval/spa_base" \
    bash run_spa.sh _2_sokoban last True "${PPO[@]}" > "$OUT/logs/spa_base.log" 2>&1 &

until grep -q "== stage 3" "$OUT/logs/spa_base.log" 2>/dev/null; do  # SFT done
    jobs -r | grep -q . || { echo "error: the runs ended before SFT finished ($OUT/logs)" >&2; exit 1; }
    sleep 10
done
SFT="$(sed -n 's/^== stage 3: PPO from \(.*\) -> .*/\1/p' "$OUT/logs/spa_base.log")"
BASE_DIR="$OUT/ppo" bash train_ppo_sfted.sh _2_sokoban "$SFT" spa_wm ctx_manager.mode=add_worldmodel "${PPO[@]}" \
    > "$OUT/logs/spa_wm.log" 2>&1 &
wait

#!/usr/bin/env bash
# GPU checks and benchmarks in one go, on one GPU (see benchmarks/RESULTS.md for recorded results).
#
#   bash benchmarks/gpu_checks.sh <out_dir>
#
# 1. one PPO step of the local backend at the paper's batch (0.5B shape, random weights), phase by phase;
# 2. one full data-generation rollout (32 × 8 envs, 5 turns, 1.5B shape) with plain generate and the static
#    decoder;
# 3. the whole tiny pipeline (data → SFT with NCCL → PPO on the GPU → evaluation) through run_spa.sh.
set -uo pipefail
out="${1:?usage: bash benchmarks/gpu_checks.sh <out_dir>}"
mkdir -p "$out"
[[ "$out" = /* ]] || out="$PWD/$out"  # the path as given, before the cd to the repository
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"

echo "== PPO step (0.5B shape, 256 trajectories, 5 turns × 400 tokens)"
python benchmarks/ppo_step.py 2>&1 | tee "$out/ppo_step.jsonl" | grep -E '^\{|Error|error' | tail -20

echo "== data-generation rollout (1.5B shape, 32 × 8 envs, 5 turns)"
python benchmarks/generation.py --rollout --no-generation --shapes 1.5b 2>&1 | tee "$out/rollout.jsonl" \
    | grep -E '^\{|Error|error' | tail -5

echo "== tiny pipeline on the GPU"
export BASE_DIR=/tmp/gpu_checks/checkpoints OUTPUT_DIR=/tmp/gpu_checks/data \
    CHECKPOINT_DIR=/tmp/gpu_checks/sft EVAL_DIR=/tmp/gpu_checks/evals
start=$(date +%s)
MODEL=tiny bash run_spa.sh _2_sokoban last True > "$out/tiny_pipeline.log" 2>&1
echo "tiny pipeline exit=$? seconds=$(( $(date +%s) - start ))"
grep -E "^== |SimpleSokoban|error" "$out/tiny_pipeline.log" | tail -30

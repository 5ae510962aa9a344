#!/usr/bin/env bash
# The verl backend on a 2-GPU machine (issue 16), each step logged and timed, later steps run even if one fails:
#   1. tests/trainer/test_verl_gpu.py (log-probs and first-update loss of verl vs local, rollout via verl's servers);
#   2. PPO with trainer.backend=verl through train_ppo_sfted.sh (random-weight 0.5B shape over the tiny tokenizer,
#      the paper's batch), a checkpoint at step FIRST, then a rerun to step TOTAL that resumes from it;
#   3. the local backend on one GPU of the same machine, same model and batch, for the phase timings beside verl's.
#
#   bash benchmarks/verl_gpu_check.sh <out_dir> [FIRST=3] [TOTAL=5] [LOCAL_STEPS=1]
# GPU_TESTS=0 skips step 1 (its tests passed on 2x H200: benchmarks/RESULTS.md).
# Needs ray, vllm and the project's dependencies importable (docs/scale_out.md, "Offline GPU hosts").
# Writes <out_dir>/summary.txt (one line per step: exit status, seconds), one log per step and the runs' metrics.
set -uo pipefail
out="${1:?usage: bash benchmarks/verl_gpu_check.sh <out_dir> [FIRST] [TOTAL] [LOCAL_STEPS]}"
first="${2:-3}" total="${3:-5}" local_steps="${4:-1}"
work="${WORK:-/tmp/verl_gpu_check}"
[[ "$out" = /* ]] || out="$PWD/$out"  # the path as given, before the cd to the repository
cd "$(dirname "$0")/.."
mkdir -p "$out" "$work"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$out/commit.txt"

run_step() {  # run_step NAME COMMAND...: log to $out/NAME.log, one summary line
    local name="$1" start rc; shift
    echo "== $name started $(date -u +%T)" | tee -a "$out/summary.txt"
    start=$(date +%s)
    "$@" > "$out/$name.log" 2>&1; rc=$?
    echo "== $name exit=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$out/summary.txt"
}

[ -f "$work/model/config.json" ] || (cd benchmarks && python random_model.py --shape 0.5b --out "$work/model")
ppo() {  # ppo NGPUS EXPERIMENT STEPS RESUME [overrides...] (one GPU: the first)
    local gpus="$1" experiment="$2" steps="$3" resume="$4"; shift 4
    local visible=(); [ "$gpus" = 1 ] && visible=(CUDA_VISIBLE_DEVICES=0)
    env "${visible[@]}" NGPUS="$gpus" MODEL=0.5B TOTAL_STEPS="$steps" RESUME="$resume" BASE_DIR="$work/runs" \
        bash train_ppo_sfted.sh _2_sokoban "$work/model" "$experiment" trainer.test_freq=-1 "$@"
}

[ "${GPU_TESTS:-1}" = 0 ] || run_step gpu_tests python -m pytest tests/trainer/test_verl_gpu.py -v -x -p no:cacheprovider
run_step verl_first ppo 2 verl "$first" 0 trainer.save_freq="$first"
run_step verl_resume ppo 2 verl "$total" 1 trainer.save_freq="$first"
run_step local_one_gpu ppo 1 local "$local_steps" 0
for run in verl local; do
    cp "$work/runs/_2_sokoban/$run/metrics.jsonl" "$out/metrics_$run.jsonl" 2>/dev/null
done
ls -R "$work/runs" > "$out/runs_tree.txt" 2>&1

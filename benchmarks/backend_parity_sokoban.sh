#!/usr/bin/env bash
# Same learning on either backend with a real model (issue 28): PPO of SmolLM2-135M-Instruct on Sokoban from one
# world-model SFT checkpoint, on the local backend and on the verl backend, same seeds, data and settings.
#
#   bash benchmarks/backend_parity_sokoban.sh <out_dir> [sft_checkpoint] [STEPS=20] [-- overrides of both runs]
#
# Without a checkpoint ("" gives STEPS without one), stages 1-2 of run_spa.sh make one first: random-action
# self-play data (CPU, seconds) and SFT on GPU 0 with SFT_OVERRIDES (default: 1 epoch, padded sdpa micro-batches of
# 8 rows, which need no compile; about 4 minutes on an H100). PPO goes through train_ppo_sfted.sh, with the
# original's base prompts: the SFT checkpoint starts near 0 there and PPO recovers the answer format within about 10
# steps (docs/smollm2.md), a learning signal both backends must show. Validation: the 128 validation puzzles ×
# VAL_SAMPLES (2) every TEST_FREQ (5) steps. SEED (0) sets trainer.seed and generator.seed; several, e.g.
# SEED="0 1 2", run one seed after the other from the same checkpoint.
# With 2 or more GPUs the two runs go side by side, local on GPU 0 and verl on GPU 1 (PARALLEL=1, the default);
# PARALLEL=0 runs them one after the other, verl on all GPUs. Per-step metrics: <out>/{local,verl}_seed<SEED>.jsonl
# (each run's config beside it as .config.yaml, the SFT's metrics as sft_metrics.jsonl),
# drawn by `python benchmarks/backend_curves.py <out> --val-episodes $((128 * VAL_SAMPLES))`.
# Needs the project's GPU dependencies (vllm, ray, verl) and the SmolLM2 file (docs/smollm2.md).
set -uo pipefail
usage="usage: bash benchmarks/backend_parity_sokoban.sh <out_dir> [sft_checkpoint] [STEPS] [-- overrides]"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
out="$1"; shift
ckpt=""; [ $# -gt 0 ] && [ "$1" != -- ] && { ckpt="$1"; shift; }
steps=20; [ $# -gt 0 ] && [ "$1" != -- ] && { steps="$1"; shift; }
[ "${1:-}" = -- ] && shift
work="${WORK:-/tmp/backend_parity_sokoban}"; seeds="${SEED:-0}"
# 1 epoch with padded sdpa micro-batches: no compile on a fresh host (flex attention compiled for minutes there)
sft_default="trainer.total_epochs=1 model.attn_implementation=sdpa data.packing=false data.micro_batch_size_per_gpu=8"
sft_overrides="${SFT_OVERRIDES:-$sft_default}"
die() { echo "error: $*" >&2; exit 2; }
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || die "STEPS must be an integer >= 1, got '$steps'"
[[ "$seeds" =~ ^[[:space:]]*[0-9]+([[:space:]]+[0-9]+)*[[:space:]]*$ ]] \
    || die "SEED takes integers >= 0, several as SEED=\"0 1 2\"; got '$seeds'"
[ -z "$ckpt" ] || [ -f "$ckpt/config.json" ] || die "'$ckpt' is not a Hugging Face model directory (no config.json)"
[ -z "$ckpt" ] || ckpt="$(cd "$ckpt" && pwd)"
[[ "$out" = /* ]] || out="$PWD/$out"  # paths as given, before the cd to the repository
[[ "$work" = /* ]] || work="$PWD/$work"
cd "$(dirname "$0")/.."
gpus="$(nvidia-smi --list-gpus 2>/dev/null | grep -c GPU)"
[ "$gpus" -ge 1 ] || die "no GPU found (nvidia-smi lists none); this benchmark needs one or more"
mkdir -p "$out" "$work"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/gpu.txt"
export MODEL=smollm2-135m PYTHONHASHSEED=10000

if [ -z "$ckpt" ]; then
    echo "== SFT checkpoint: stages 1-2 -> $work/sft $(date -u +%T)" | tee -a "$out/summary.txt"
    data_stage="$(python -m SPA_agent.stages data --config=_2_sokoban --model=smollm2-135m \
        --render-mode=text_with_coordinates --generator=random --batches=5 --output-dir="$work/data")" || exit 2
    mapfile -t data_stage <<< "$data_stage"
    python "${data_stage[@]}" > "$out/data.log" 2>&1 || { echo "error: data ($out/data.log)" >&2; exit 1; }
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 bash sft/finetune_ft.sh _2_sokoban 1 "$work/sft" "$work/data" smollm2-135m $sft_overrides \
        > "$out/sft.log" 2>&1 || { echo "error: SFT ($out/sft.log)" >&2; exit 1; }
    ckpt="$(ls -d "$work"/sft/global_step_* | sort -V | tail -1)"
    cp "$work/data/data_card.md" "$out/" 2>/dev/null
    cp "$work/sft/metrics.jsonl" "$out/sft_metrics.jsonl" 2>/dev/null
fi
echo "== PPO from $ckpt" | tee -a "$out/summary.txt"

run() {  # run BACKEND GPU_LIST SEED [overrides...]
    local backend="$1" visible="$2" seed="$3" n start rc name="${1}_seed$3"; shift 3
    n="$(tr ',' '\n' <<< "$visible" | grep -c .)"
    echo "== $name on GPU $visible started $(date -u +%T)" | tee -a "$out/summary.txt"
    start=$(date +%s)
    CUDA_VISIBLE_DEVICES="$visible" NGPUS="$n" TOTAL_STEPS="$steps" BASE_DIR="$work/runs" \
        bash train_ppo_sfted.sh _2_sokoban "$ckpt" "$name" trainer.backend="$backend" \
        trainer.seed="$seed" generator.seed="$seed" trainer.test_freq="${TEST_FREQ:-5}" \
        es_manager.val.group_size="${VAL_SAMPLES:-2}" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "== $name exit=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$out/summary.txt"
    cp "$work/runs/_2_sokoban/$name/metrics.jsonl" "$out/$name.jsonl" 2>/dev/null
    cp "$work/runs/_2_sokoban/$name/config.yaml" "$out/$name.config.yaml" 2>/dev/null
}

for seed in $seeds; do
    if [ "$gpus" -ge 2 ] && [ "${PARALLEL:-1}" = 1 ]; then
        # One GPU each: Ray then restricts each verl worker to the driver's GPU (all_gpus_visible=false).
        run local 0 "$seed" "$@" &
        run verl 1 "$seed" verl_backend.all_gpus_visible=false "$@" &
        wait
    else
        run local 0 "$seed" "$@"
        run verl "$(seq -s, 0 $(( gpus - 1 )))" "$seed" "$@"
    fi
done

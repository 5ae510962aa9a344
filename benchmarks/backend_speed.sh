#!/usr/bin/env bash
# One PPO step of each backend on the same machine in one run (issue 28): the local backend on one GPU, then the
# verl backend on all of them or on VERL_GPUS (Ray/FSDP workers, vLLM rollout engines), same model, batch and
# settings.
#
#   bash benchmarks/backend_speed.sh <out_dir> [STEPS=4] [SHAPE=0.5b] [-- extra overrides of both runs]
#   VERL_GPUS=4 bash benchmarks/backend_speed.sh /tmp/speed_1.5b 4 1.5b   # issue 46: 1.5B, local 1 GPU vs verl 4
#
# Model: random weights of SHAPE over the tiny tokenizer (benchmarks/random_model.py), so no download; batch: the
# paper's (_2_sokoban: 32 groups × 8 trajectories, up to 5 turns × 400 tokens, 25% of the groups trained). Each run
# goes through train_ppo_sfted.sh (what a user runs; with NGPUS > 1 it picks trainer.backend=verl and
# ROLLOUT_TP=auto). VERL_ARGS adds overrides to the verl run only; BACKENDS="verl" (or "local") runs one backend
# only, e.g. a verl setting against a local step measured before on the same machine (the table then needs both
# runs' metrics in <out>: backend_table.py compares any two); VERL_GPUS=N runs verl on the first N GPUs (default:
# every GPU nvidia-smi lists; N must not exceed them); SHAPE is 0.5b or 1.5b (benchmarks/model_shapes.py; MODEL
# of train_ppo_sfted.sh: 0.5B or 1.5B, whose presets set the batch); VOCAB=full gives the model the shape's own
# vocabulary (151,936 ids for the Qwen shapes) instead of the tiny tokenizer's 860 (random_model.py --full-vocab).
# Writes <out>/metrics_{local,verl}.jsonl, a log per run, summary.txt (exit status and seconds of each run) and
# table.md (benchmarks/backend_table.py: the phases' steady seconds, the median of the steps after the first, side
# by side).
# Needs ray, vllm and the project's dependencies importable (docs/scale_out.md, "Offline GPU hosts").
set -uo pipefail
out="${1:?usage: bash benchmarks/backend_speed.sh <out_dir> [STEPS] [SHAPE] [-- overrides]}"; shift
steps="${1:-4}"; [ $# -gt 0 ] && shift
shape="${1:-0.5b}"; [ $# -gt 0 ] && shift
[ "${1:-}" = -- ] && shift
work="${WORK:-/tmp/backend_speed}"
backends="${BACKENDS:-local verl}"
die() { echo "error: $*" >&2; exit 2; }
for backend in $backends; do
    case "$backend" in local|verl) ;; *) die "BACKENDS takes local and/or verl, got '$backend'" ;; esac
done
case "$shape" in
    0.5b|1.5b) ;;
    *) die "SHAPE takes 0.5b or 1.5b, got '$shape'" ;;
esac
case "${VERL_GPUS:-}" in
    "") ;;
    *[!0-9]*|0*) die "VERL_GPUS takes a number of GPUs ≥ 1 (or nothing: every GPU), got '$VERL_GPUS'" ;;
esac
case "${VOCAB:-}" in
    ""|full) ;;
    *) die "VOCAB takes full (or nothing: the tiny tokenizer's 860 ids), got '$VOCAB'" ;;
esac
[[ "$out" = /* ]] || out="$PWD/$out"  # the path as given, before the cd to the repository
cd "$(dirname "$0")/.."
mkdir -p "$out" "$work"
gpus="$(nvidia-smi --list-gpus | grep -c GPU)"
verl_gpus="${VERL_GPUS:-$gpus}"
[ "$verl_gpus" -le "$gpus" ] || die "VERL_GPUS=$verl_gpus but nvidia-smi lists $gpus GPUs"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
model="$work/model_$shape"; vocab_args=()
[ "${VOCAB:-}" = full ] && model="${model}_full_vocab" && vocab_args=(--full-vocab)
[ -f "$model/config.json" ] ||
    (cd benchmarks && python random_model.py --shape "$shape" --out "$model" "${vocab_args[@]}")

run() {  # run NAME NGPUS [overrides...]: train_ppo_sfted.sh on the first NGPUS GPUs
    local name="$1" n="$2" start rc; shift 2
    local visible; visible="$(seq -s, 0 $(( n - 1 )))"
    echo "== $name ($n GPU) started $(date -u +%T)" | tee -a "$out/summary.txt"
    start=$(date +%s)
    CUDA_VISIBLE_DEVICES="$visible" NGPUS="$n" MODEL="${shape^^}" TOTAL_STEPS="$steps" BASE_DIR="$work/runs" \
        bash train_ppo_sfted.sh _2_sokoban "$model" "$name" trainer.test_freq=-1 "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "== $name exit=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$out/summary.txt"
    cp "$work/runs/_2_sokoban/$name/metrics.jsonl" "$out/metrics_$name.jsonl" 2>/dev/null
}

case " $backends " in *" local "*) run local 1 "$@" ;; esac
# shellcheck disable=SC2086
case " $backends " in *" verl "*) run verl "$verl_gpus" "$@" ${VERL_ARGS:-} ;; esac
if [ -f "$out/metrics_local.jsonl" ] && [ -f "$out/metrics_verl.jsonl" ]; then
    python benchmarks/backend_table.py "$out/metrics_local.jsonl" "$out/metrics_verl.jsonl" \
        --labels "local (1 GPU)" "verl ($verl_gpus GPUs)" | tee "$out/table.md"
fi

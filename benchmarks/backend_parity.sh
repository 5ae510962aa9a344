#!/usr/bin/env bash
# Same learning on either backend (issue 28): the PPO learning test's bandit (config/_bandit.yaml, GAE with the
# test's critic warm-up) from one SFT checkpoint, on the local backend (one GPU) and on the verl backend (all GPUs),
# with the same seeds (trainer.seed: critic init; generator.seed: sampling). Per-step metrics of every run go to
# <out>/<backend>_seed<s>.jsonl; benchmarks/backend_curves.py draws them side by side.
#
#   bash benchmarks/backend_parity.sh <out_dir> <sft_checkpoint> [SEEDS="0 1"] [-- overrides of every run]
#
# The checkpoint is the learning test's (stages 1-2 on CPU, seconds):
#   python -c "from pathlib import Path; import sys; sys.path.insert(0, 'tests/trainer');
#              from test_learning import bandit_sft_checkpoint; print(bandit_sft_checkpoint(Path('bandit'), []))"
set -uo pipefail
out="${1:?usage: bash benchmarks/backend_parity.sh <out_dir> <sft_checkpoint> [SEEDS] [-- overrides]}"
ckpt="${2:?usage: bash benchmarks/backend_parity.sh <out_dir> <sft_checkpoint> [SEEDS] [-- overrides]}"; shift 2
seeds="${1:-0 1}"; [ $# -gt 0 ] && shift
[ "${1:-}" = -- ] && shift
work="${WORK:-/tmp/backend_parity}"
[[ "$out" = /* ]] || out="$PWD/$out"; [[ "$ckpt" = /* || ! -e "$ckpt" ]] || ckpt="$PWD/$ckpt"  # as given, before the cd
cd "$(dirname "$0")/.."
mkdir -p "$out" "$work"
gpus="$(nvidia-smi --list-gpus | grep -c GPU)"

run() {  # run BACKEND NGPUS SEED [overrides...]
    local backend="$1" n="$2" seed="$3" start rc; shift 3
    local name="${backend}_seed$seed"
    echo "== $name started $(date -u +%T)" | tee -a "$out/summary.txt"
    start=$(date +%s)
    CUDA_VISIBLE_DEVICES="$(seq -s, 0 $(( n - 1 )))" python -m SPA_agent.trainer.main_ppo --config-name _bandit \
        model_path="$ckpt" algorithm.adv_estimator=gae trainer.critic_warmup=2 trainer.device=cuda \
        trainer.backend="$backend" trainer.n_gpus_per_node="$n" trainer.seed="$seed" generator.seed="$seed" \
        trainer.default_local_dir="$work/$name" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "== $name exit=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$out/summary.txt"
    cp "$work/$name/metrics.jsonl" "$out/$name.jsonl" 2>/dev/null
}

for seed in $seeds; do
    run local 1 "$seed" "$@"
    run verl "$gpus" "$seed" "$@"
done

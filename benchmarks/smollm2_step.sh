#!/usr/bin/env bash
# Issue 42 on one GPU, in one command: SmolLM2's SFT epoch and PPO step, timed stage by stage.
#
#   bash benchmarks/smollm2_step.sh <out> [data_dir] [smollm2_step.py arguments...]
#
# Stages, each under a time limit and logged to <out>/<stage>.log, with one line `<stage> <seconds> <exit status>`
# appended to <out>/times.tsv as it ends (so a run cut short still says how far it got):
#   check    python, torch, CUDA and this package import (60 s): a host that hangs shows it here, not later
#   convert  the SmolLM2 GGUF into the cache (python -m SPA_agent.smollm2; SPA_SMOLLM2_GGUF names the file)
#   data     random-action self-play data for Sokoban (skipped when [data_dir] is given)
#   sft      one SFT epoch through sft/finetune_ft.sh, start-up included (the issue's ≤ 60 s), with SFT_OVERRIDES
#   step     benchmarks/smollm2_step.py from the SFT checkpoint: PPO steps and one validation of 128 × 4
#   step_<name>  the same from the same checkpoint once per line `<name> <overrides...>` of STEP_VARIANTS
# Environment: SFT_OVERRIDES (extra SFT overrides, space separated), STEP_TIMEOUT (s, 900), SFT_TIMEOUT (s, 900),
# STEP_VARIANTS (lines of `<name> <config overrides>`, e.g. "nockpt generator.compile_decode_step=true"), SFT_ONLY=1
# (stop after the sft stage: the SFT epoch alone, as a lease that needs its minutes for other work times it).
# A stage still running at its limit is stopped with SIGABRT, so Python prints every thread's stack into its log
# (PYTHONFAULTHANDLER), after `py-spy dump` of its processes where py-spy is installed; then its process group is
# killed (no orphaned SFT rank keeps the GPU).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bash benchmarks/smollm2_step.sh <out> [data_dir] [smollm2_step.py arguments...]" >&2; exit 2; }
DATA="${2:-}"
# stage 1's training split, named by the stage definition (SPA_agent/stages.py)
TRAIN_FILE="$(cd "$(dirname "$0")/.." && python -c 'from SPA_agent.stages import TRAIN_FILE; print(TRAIN_FILE)')" || exit 2
[ -z "$DATA" ] || [ -f "$DATA/$TRAIN_FILE" ] || { echo "error: '$DATA' holds no $TRAIN_FILE" >&2; exit 2; }
[ -z "$DATA" ] || DATA="$(cd "$DATA" && pwd)"
OUT="$(mkdir -p "$1" && cd "$1" && pwd)" || exit 2
shift $(( $# < 2 ? $# : 2 ))
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONHASHSEED=10000 PYTHONFAULTHANDLER=1
: > "$OUT/times.tsv"

# stage NAME LIMIT COMMAND...: run COMMAND under LIMIT seconds into <out>/NAME.log; record its time and status.
stage() {
    local name="$1" limit="$2" start status pid watchdog
    shift 2
    start=$EPOCHREALTIME
    echo "== $name (at most $limit s)"
    setsid "$@" > "$OUT/$name.log" 2>&1 &
    pid=$!
    (
        sleep "$limit"
        if command -v py-spy > /dev/null; then
            for p in $(pgrep -g "$pid"); do py-spy dump --pid "$p" >> "$OUT/$name.stacks.txt" 2>&1; done
        fi
        kill -ABRT -- -"$pid" 2>/dev/null; sleep 5; kill -KILL -- -"$pid" 2>/dev/null
    ) &
    watchdog=$!
    wait "$pid"
    status=$?
    pkill -P "$watchdog" 2>/dev/null; kill "$watchdog" 2>/dev/null
    awk -v n="$name" -v a="$start" -v b="$EPOCHREALTIME" -v s="$status" 'BEGIN { printf "%s\t%.1f\t%s\n", n, b - a, s }' \
        >> "$OUT/times.tsv"
    [ "$status" -eq 0 ] || { echo "error: stage $name ended with status $status; see $OUT/$name.log" >&2; exit 1; }
}

# -X importtime: a hang in an import shows as the last module in check.log
stage check 60 python -X importtime -c "import torch, SPA_agent.smollm2, SPA_agent.trainer.main_ppo; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
stage convert 300 python -m SPA_agent.smollm2
if [ -z "$DATA" ]; then
    DATA="$OUT/data"
    data_stage="$(python -m SPA_agent.stages data --config=_2_sokoban --model=smollm2-135m --generator=random \
        --batches=5 --output-dir="$DATA")" || exit 2
    mapfile -t data_stage <<< "$data_stage"
    stage data 300 python "${data_stage[@]}"
fi
# shellcheck disable=SC2086
stage sft "${SFT_TIMEOUT:-900}" bash sft/finetune_ft.sh _2_sokoban 1 "$OUT/sft" "$DATA" smollm2-135m \
    trainer.total_epochs=1 ${SFT_OVERRIDES:-}
[ "${SFT_ONLY:-0}" = 1 ] && { cat "$OUT/times.tsv"; exit 0; }
CKPT="$(ls -d "$OUT"/sft/global_step_* | sort -V | tail -1)"
stage step "${STEP_TIMEOUT:-900}" python benchmarks/smollm2_step.py --model-path "$CKPT" --json "$OUT/step.json" "$@"
while read -r name overrides; do
    [ -n "$name" ] || continue
    # shellcheck disable=SC2086
    stage "step_$name" "${STEP_TIMEOUT:-900}" python benchmarks/smollm2_step.py --model-path "$CKPT" \
        --json "$OUT/step_$name.json" "$@" $overrides
done <<< "${STEP_VARIANTS:-}"
cat "$OUT/times.tsv"

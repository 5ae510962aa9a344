#!/usr/bin/env bash
# Issue 26, a PPO settings sweep for SmolLM2-135M-Instruct on SimpleSokoban on one GPU, after
# benchmarks/smollm2_sokoban.sh showed no learning at lr 1e-5 in 30 steps: the same random-action data and SFT,
# then one PPO run per line of SETTINGS ("<name> <hydra overrides...>"), side by side, all with the prompts of MODE
# (add_worldmodel, the SFT's own, by default; base is the original's PPO mode).
#
#   OUT=smollm2_sweep STEPS=60 bash benchmarks/smollm2_sweep.sh
#   MODE=base STEPS=300 TEST_FREQ=25 SETTINGS="$(cat settings.txt)" bash benchmarks/smollm2_sweep.sh   # issue 43's plan
#
# Each run gets one GPU, round-robin over the host's GPUs (GPUS: how many to use, default every GPU nvidia-smi
# lists; or GPU_IDS, the devices by number, e.g. "2 3", so that two sweeps share a host), so four settings on a
# four-GPU host run one a GPU, and more settings than GPUs share them; each run is the local backend on its GPU
# (NGPUS=1), never verl over all of them. The SFT before them runs on the first SFT_GPUS of those GPUs (default 1;
# torchrun, one rank a GPU): its steps are short, so a multi-GPU host gets its arms started sooner.
# GENERATOR: stage 1's generator, random (the random-action data, default) or solver (issue 43's ceiling data).
# A setting may choose its own prompts with ctx_manager.mode=... among its overrides (they come after MODE's).
# Checkpoints every SAVE_FREQ steps (default TEST_FREQ; 0: only at the last step, for a host that is given back
# before a run could resume from them).
set -euo pipefail
OUT="${OUT:-smollm2_sweep}"; [[ "$OUT" = /* ]] || OUT="$PWD/$OUT"  # relative to the caller's directory
cd "$(dirname "$0")/.."
STEPS="${STEPS:-60}"; TEST_FREQ="${TEST_FREQ:-10}"; VAL_SAMPLES="${VAL_SAMPLES:-4}"; MODE="${MODE:-add_worldmodel}"
case "$MODE" in base|add_worldmodel) ;; *) echo "error: MODE must be base or add_worldmodel, got '$MODE'" >&2; exit 2 ;; esac
SETTINGS="${SETTINGS:-gae_lr3e-5 actor_rollout_ref.actor.optim.lr=3e-5 critic.optim.lr=1e-4
gae_lr1e-4_kl actor_rollout_ref.actor.optim.lr=1e-4 critic.optim.lr=1e-4 actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.05 actor_rollout_ref.actor.kl_loss_type=low_var_kl
grpo_lr3e-5 algorithm.adv_estimator=grpo actor_rollout_ref.actor.optim.lr=3e-5}"
GPUS="${GPUS:-$(nvidia-smi --list-gpus 2>/dev/null | grep -c GPU || true)}"
case "$GPUS" in ""|*[!0-9]*) echo "error: GPUS takes a number of GPUs, got '$GPUS'" >&2; exit 2 ;; esac
SFT_GPUS="${SFT_GPUS:-1}"
case "$SFT_GPUS" in ""|0|*[!0-9]*) echo "error: SFT_GPUS takes a number of GPUs (at least 1), got '$SFT_GPUS'" >&2; exit 2 ;; esac
GENERATOR="${GENERATOR:-random}"
case "$GENERATOR" in random|solver) ;; *) echo "error: GENERATOR must be random or solver, got '$GENERATOR'" >&2; exit 2 ;; esac
every_gpu=""; [ "$GPUS" -eq 0 ] || every_gpu="$(seq -s ' ' 0 $(( GPUS - 1 )))"
read -ra GPU_LIST <<< "${GPU_IDS:-$every_gpu}"
for id in "${GPU_LIST[@]}"; do
    case "$id" in *[!0-9]*) echo "error: GPU_IDS takes GPU numbers separated by spaces, got '$GPU_IDS'" >&2; exit 2 ;; esac
done
GPUS=${#GPU_LIST[@]}
export MODEL=smollm2-135m
mkdir -p "$OUT/logs"
PPO=(ctx_manager.mode="$MODE" trainer.total_training_steps="$STEPS" trainer.test_freq="$TEST_FREQ"
     trainer.save_freq="${SAVE_FREQ:-$TEST_FREQ}" es_manager.val.group_size="$VAL_SAMPLES")

python -m SPA_agent.smollm2 > "$OUT/logs/convert.log" 2>&1
# Stages 1 and 2 as run_spa.sh runs them for MODEL=smollm2-135m.
DATA_STAGE="$(python -m SPA_agent.stages data --config=_2_sokoban --model=smollm2-135m --generator="$GENERATOR" \
    --output-dir="$OUT/data")" || exit 2
mapfile -t DATA_STAGE <<< "$DATA_STAGE"
python "${DATA_STAGE[@]}" > "$OUT/logs/data.log" 2>&1
# the preset's SFT defaults, as run_spa.sh passes them (2 epochs, packed attention: nothing to compile)
. scripts/common.sh
model_settings smollm2-135m
sft_placement=()  # the first SFT_GPUS of the sweep's GPUs
[ "$GPUS" -gt 0 ] && sft_placement=(CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${GPU_LIST[*]:0:$SFT_GPUS}")")
# shellcheck disable=SC2086
env "${sft_placement[@]}" bash sft/finetune_ft.sh _2_sokoban "$SFT_GPUS" "$OUT/sft" "$OUT/data" smollm2-135m \
    $MODEL_SFT_DEFAULTS > "$OUT/logs/sft.log" 2>&1
SFT="$(ls -d "$OUT"/sft/global_step_* | sort -V | tail -n 1)"
run=0
while read -r name overrides; do
    placement=()  # one GPU a run, round-robin; none on a CPU host
    [ "$GPUS" -gt 0 ] && placement=(CUDA_VISIBLE_DEVICES="${GPU_LIST[$(( run % GPUS ))]}" NGPUS=1)
    echo "$name: ${placement[*]:-CPU}" >> "$OUT/logs/placement.txt"
    # shellcheck disable=SC2086
    env "${placement[@]}" BASE_DIR="$OUT/ppo" bash train_ppo_sfted.sh _2_sokoban "$SFT" "$name" "${PPO[@]}" \
        $overrides > "$OUT/logs/$name.log" 2>&1 &
    run=$(( run + 1 ))
done <<< "$SETTINGS"
wait

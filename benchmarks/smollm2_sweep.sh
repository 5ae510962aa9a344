#!/usr/bin/env bash
# Issue 26, a PPO settings sweep for SmolLM2-135M-Instruct on SimpleSokoban (or FrozenLake: CONFIG below) on one
# GPU, after benchmarks/smollm2_sokoban.sh showed no learning at lr 1e-5 in 30 steps: the same random-action data and
# SFT (or another start, START below), then one PPO run per line of SETTINGS ("<name> <hydra overrides...>"), side
# by side, all with the prompts of MODE (add_worldmodel, the SFT's own, by default; base is the original's PPO mode).
# `{data}` in a setting's overrides stands for the folder of the data the SFT trains on (e.g. PPO-ptx's SFT rows:
# actor_rollout_ref.actor.sft_aux_files={data}/wm_train.parquet, docs/ppo.md).
#
#   OUT=smollm2_sweep STEPS=60 bash benchmarks/smollm2_sweep.sh
#   MODE=base STEPS=300 TEST_FREQ=25 SETTINGS="$(cat settings.txt)" bash benchmarks/smollm2_sweep.sh   # issue 43's plan
#
# CONFIG: the entry config of every stage, _2_sokoban (SimpleSokoban, default) or _3_frozen_lake (FrozenLake 4x4);
# an unknown one is one line and exit status 2. The runs go to $OUT/ppo/$CONFIG/<name>. On _3_frozen_lake with
# smollm2-135m every run's rollouts get 320 new tokens a turn instead of the preset's 256, before the settings'
# overrides: the coordinate sentence names every hole, and a response in the SFT's format on a map with 7 or 8
# holes is 268-286 SmolLM2 tokens (docs/results/smollm2_table2/README.md, "FrozenLake 4x4").
#
# Each run gets one GPU, round-robin over the host's GPUs (GPUS: how many to use, default every GPU nvidia-smi
# lists; or GPU_IDS, the devices by number, e.g. "2 3", so that two sweeps share a host), so four settings on a
# four-GPU host run one a GPU, and more settings than GPUs share them; each run is the local backend on its GPU
# (NGPUS=1), never verl over all of them. The SFT before them runs on the first SFT_GPUS of those GPUs (default 1;
# torchrun, one rank a GPU): its steps are short, so a multi-GPU host gets its arms started sooner.
# GENERATOR: stage 1's generator, random (the random-action data, default) or solver (issue 43's ceiling data;
# Sokoban only, refused on FrozenLake before any stage runs).
# START: what the runs start from: wm (default) the SFT on the self-play data; nowm the SFT on the same rows in the
# base format, without <observation>/<prediction> (SPA_agent.selfplay.without_worldmodel: the format-only control);
# nopred the SFT on the self-play data without the loss of the <prediction> contents (data.loss_target=
# without_prediction, after SFT_OVERRIDES: it learns the current state and the answer, not the next state); nostate
# the same without the loss of the <observation> contents either (data.loss_target=without_states: the format and
# the answer, neither state); base the untouched model, no data and no SFT (Vanilla RL).
# A setting may choose its own prompts with ctx_manager.mode=... among its overrides (they come after MODE's), and
# anything else a PPO override can: experiment=vanilla_rl (the plain symbol grid), trainer.seed=1 generator.seed=1
# (a run's seed: the critic's initialisation and the rollouts' sampling; the puzzles stay seed.train's).
# Every setting's PPO config is checked before the first stage runs (SPA_agent/pipeline_check.py).
# Checkpoints every SAVE_FREQ steps (default TEST_FREQ; 0: only at the last step, for a host that is given back
# before a run could resume from them). SFT_OVERRIDES: Hydra overrides of the SFT after the preset's defaults (as
# run_spa.sh's). MODEL: smollm2-135m (default), or tiny for a CPU check of the plumbing.
# WAIT_FOR: a file to wait for before the runs start (unset: they start at once). Once its data and SFT are done (at
# once for START=base) the sweep writes its runs' starting model into $OUT/logs/ready, waits until WAIT_FOR exists
# and adds the file's Hydra overrides (separated by whitespace; none if empty) after every setting's, e.g.
# agent_proxy.pipeline_turns=true from docs/results/smollm2_table2/job.sh's speed gate. The check before the
# first stage cannot know them: each run's own config checks (SPA_agent/trainer/config_checks.py) refuse a bad one
# when it starts.
# WM_EVAL=1: the world model's accuracy where PPO did not ask for it (runs in base prompts, issue 43's Table 2): each
# run's last checkpoint, once the run has ended well (its GPU share freed), plays the validation puzzles (VAL_SAMPLES
# each) in the SFT's own prompts (add_worldmodel; SPA_agent.evaluate on the run's GPU) into $OUT/wm_eval/<run>/eval.json
# (observation and prediction exact among its numbers; the log beside it). The SFT's own accuracy is the step-0
# validation of a run in add_worldmodel prompts.
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
START="${START:-wm}"
case "$START" in wm|nowm|nopred|nostate|base) ;; *) echo "error: START must be wm, nowm, nopred, nostate or base, got '$START'" >&2; exit 2 ;; esac
every_gpu=""; [ "$GPUS" -eq 0 ] || every_gpu="$(seq -s ' ' 0 $(( GPUS - 1 )))"
read -ra GPU_LIST <<< "${GPU_IDS:-$every_gpu}"
for id in "${GPU_LIST[@]}"; do
    case "$id" in *[!0-9]*) echo "error: GPU_IDS takes GPU numbers separated by spaces, got '$GPU_IDS'" >&2; exit 2 ;; esac
done
GPUS=${#GPU_LIST[@]}
export MODEL="${MODEL:-smollm2-135m}"
. scripts/common.sh
CONFIG="${CONFIG:-_2_sokoban}"
check_config "$CONFIG"
model_settings "$MODEL"
PPO=(ctx_manager.mode="$MODE" trainer.total_training_steps="$STEPS" trainer.test_freq="$TEST_FREQ"
     trainer.save_freq="${SAVE_FREQ:-$TEST_FREQ}" es_manager.val.group_size="$VAL_SAMPLES")
[ "$CONFIG:$MODEL" = _3_frozen_lake:smollm2-135m ] && PPO+=(actor_rollout_ref.rollout.response_length=320)
DATA="$OUT/data"; [ "$START" = nowm ] && DATA="$OUT/data_nowm"  # what the SFT trains on
SETTINGS="${SETTINGS//\{data\}/$DATA}"
# Stages 1 and 2 as run_spa.sh runs them: the preset's SFT defaults (for smollm2-135m 2 epochs, packed attention).
DATA_STAGE="$(python -m SPA_agent.stages data --config="$CONFIG" --model="$MODEL_PRESET" --generator="$GENERATOR" \
    --output-dir="$OUT/data")" || exit 2
mapfile -t DATA_STAGE <<< "$DATA_STAGE"
# shellcheck disable=SC2206
SFT_STAGE=("$CONFIG" "$SFT_GPUS" "$OUT/sft" "$DATA" "$MODEL" $MODEL_SFT_DEFAULTS ${SFT_OVERRIDES:-})
[ "$START" = nopred ] && SFT_STAGE+=(data.loss_target=without_prediction)
[ "$START" = nostate ] && SFT_STAGE+=(data.loss_target=without_states)
if [ "$START" = base ]; then
    START_MODEL="$(python -c "from SPA_agent.config import compose
print(compose('$CONFIG', ['model=$MODEL_PRESET']).model_path)")"  # the preset's model, as run_baseline.sh's
else
    START_MODEL="$OUT/sft/global_step_N"  # stands in for the checkpoint stage 2 will make, in the check below
fi

# Every stage's settings, each setting's PPO overrides included (not WAIT_FOR's), checked before the first stage
# runs (the runs as they will run: one GPU each).
STAGES=()
[ "$START" = base ] || STAGES+=("$(printf '%s\n' "${DATA_STAGE[@]}")"
                               "$(SPA_PRINT_STAGE=1 bash sft/finetune_ft.sh "${SFT_STAGE[@]}")")
one_gpu=(); [ "$GPUS" -gt 0 ] && one_gpu=(NGPUS=1)
while read -r name overrides; do
    # shellcheck disable=SC2086
    STAGES+=("$(env "${one_gpu[@]}" SPA_PRINT_STAGE=1 BASE_DIR="$OUT/ppo" bash train_ppo_sfted.sh "$CONFIG" \
        "$START_MODEL" "$name" "${PPO[@]}" $overrides)")
done <<< "$SETTINGS"
check_stages "${STAGES[@]}"

mkdir -p "$OUT/logs"
rm -f "$OUT/logs/ready"  # a caller waiting for it must not see an earlier sweep's
stamp() { echo "$(date -u +%T) $*" >> "$OUT/logs/stages.txt"; }  # when each stage ended (wall times of a lease)
wm_eval() {  # <checkpoint> <name> [placement...]: WM_EVAL's evaluation of one checkpoint, printed with SPA_PRINT_STAGE
    [ "${WM_EVAL:-0}" = 1 ] || return 0
    local command=(python -m SPA_agent.evaluate --config-name "$CONFIG" model="$MODEL_PRESET" model_path="$1"
                   evaluation.prompt_mode=add_worldmodel evaluation.n="$VAL_SAMPLES" evaluation.overwrite=true
                   evaluation.write_trajectories=false evaluation.write_plots=false
                   evaluation.output_dir="$OUT/wm_eval/$2")
    mkdir -p "$OUT/wm_eval"
    if [ -n "${SPA_PRINT_STAGE:-}" ]; then echo "${command[*]}" > "$OUT/wm_eval/$2.log"
    else env "${@:3}" "${command[@]}" > "$OUT/wm_eval/$2.log" 2>&1 || true; fi  # a failed one leaves its log
}
stamp "checks done"
if [ "$MODEL" = smollm2-135m ]; then
    python -m SPA_agent.smollm2 > "$OUT/logs/convert.log" 2>&1
    stamp "model converted"
fi
if [ "$START" != base ]; then
    python "${DATA_STAGE[@]}" > "$OUT/logs/data.log" 2>&1
    [ "$START" = nowm ] && python -m SPA_agent.selfplay.without_worldmodel --config-name "$CONFIG" "$OUT/data" \
        "$DATA" model="$MODEL_PRESET" >> "$OUT/logs/data.log" 2>&1
    stamp "data done"
    sft_placement=()  # the first SFT_GPUS of the sweep's GPUs
    [ "$GPUS" -gt 0 ] && sft_placement=(CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${GPU_LIST[*]:0:$SFT_GPUS}")")
    env "${sft_placement[@]}" bash sft/finetune_ft.sh "${SFT_STAGE[@]}" > "$OUT/logs/sft.log" 2>&1
    stamp "SFT done"
    START_MODEL="$(latest_checkpoint "$OUT/sft")"
fi
GATE=()  # WAIT_FOR's overrides, after every setting's
if [ -n "${WAIT_FOR:-}" ]; then
    echo "$START_MODEL" > "$OUT/logs/ready"
    while [ ! -e "$WAIT_FOR" ]; do sleep 2; done
    read -ra GATE <<< "$(tr '\n' ' ' < "$WAIT_FOR")"
    echo "overrides from $WAIT_FOR: ${GATE[*]:-none}" >> "$OUT/logs/placement.txt"
fi
stamp "arms start"
run=0
while read -r name overrides; do
    placement=()  # one GPU a run, round-robin; none on a CPU host
    [ "$GPUS" -gt 0 ] && placement=(CUDA_VISIBLE_DEVICES="${GPU_LIST[$(( run % GPUS ))]}" NGPUS=1)
    echo "$name: ${placement[*]:-CPU}" >> "$OUT/logs/placement.txt"
    # shellcheck disable=SC2086
    (env "${placement[@]}" BASE_DIR="$OUT/ppo" bash train_ppo_sfted.sh "$CONFIG" "$START_MODEL" "$name" "${PPO[@]}" \
         $overrides "${GATE[@]}" > "$OUT/logs/$name.log" 2>&1
     if last="$(latest_checkpoint "$OUT/ppo/$CONFIG/$name" 2>/dev/null)"; then
         wm_eval "$last/actor" "$name" "${placement[@]}"
     fi) &
    run=$(( run + 1 ))
done <<< "$SETTINGS"
wait

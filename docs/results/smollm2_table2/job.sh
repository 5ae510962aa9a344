#!/usr/bin/env bash
# Issue 43: the paper's Table 2 rows for SmolLM2-135M-Instruct on SimpleSokoban, one lease (README.md beside this
# file); CONFIG=_3_frozen_lake runs them on FrozenLake 4x4 instead (below). Written for nvidia-h200-x2; uses every
# GPU of a larger host. The calling lease joins the SmolLM2 GGUF into /tmp/smol.gguf, installs the CPU wheels (ray
# included) into /tmp/site and starts this script (setsid) from a copy of the tree in /tmp/repo, as
# docs/results/smollm2_study2/job.sh:
#   1. carry gguf part aa and the first wheels: mkdir -p /tmp/p && cp <part aa> <wheels>/* /tmp/p/
#   2. carry part ab and the next wheels, the same way
#   3. carry part ac and ray's wheels, then: cat /tmp/p/<parts> > /tmp/smol.gguf (check its sha256),
#      pip install --no-index --no-deps --target /tmp/site /tmp/p/*.whl, cp -r "$PWD" /tmp/repo,
#      (setsid nohup bash /tmp/repo/docs/results/smollm2_table2/job.sh > /tmp/job.log 2>&1 &)
#   then calls that sleep, print /tmp/out/progress.txt and end with collect.sh (the results so far, without
#   checkpoints, into $OUT; it prints each arm's last step and validations).
#
# The arms are the lines of arms.txt ("<name> <start> <PPO overrides>"), in priority order: SPA, format-only and
# Vanilla RL with seed 0, then seeds 1 and 2 of SPA, then of format-only, then of Vanilla RL. The first
# ARMS_PER_GPU (2) x GPUs of them run (ARMS="name ..." picks others, e.g. the rest in a later lease); arm i goes to
# GPU i mod GPUs, or to the GPU a name in ARMS gives it after an @ (ARMS="spa_s0 format_s0@1 format_s1@1": SPA alone
# on GPU 0, the two format-only seeds side by side on GPU 1). Up to five sweeps of benchmarks/smollm2_sweep.sh run
# side by side, one per start:
#   wm    random-action data, world-model SFT (2 epochs) on the first GPU of its arms, then its arms (SPA);
#   nowm  the same data without state blocks, SFT on the first GPU of its arms, then its arms (format-only);
#   nopred the same data, SFT without the loss of the <prediction> contents, then its arms (issue 43's ablation of
#         the transition model: the SFT learns the current state and the answer, not the next state);
#   nostate the same data, SFT without the loss of the <observation> and <prediction> contents, then its arms (the
#         ablation of both states: the SFT learns the add_worldmodel format and the answer, neither state);
#   base  no data, no SFT: its arms start at once from the untouched model (Vanilla RL).
# The two SFTs run side by side (spa_s0 is on GPU 0, format_s0 on GPU 1). Every arm: GAE, actor lr 1e-5, critic
# 1e-4, validation at step 0 and every 25 steps on 128 puzzles x 4, up to 300 steps (the lease ends them sooner).
#
# Measured in lease 1 (one H200, spa_s0, format_s0 and vanilla_s0 on the one GPU; README.md beside this file): data
# and the two SFTs ~5 minutes, then in ~25 minutes SPA reached step 51 (19.1 s a step), format-only 141 (7.9 s) and
# Vanilla RL 52 (24.7 s: its samples run to the cap). One arm alone takes ~9.4 s a step. On nvidia-h200-x2 four arms
# run (spa_s0 format_s0 vanilla_s0 spa_s1), on nvidia-h200-x4 eight. Two a GPU, not three: in lease 7 a third arm
# on one H200 ran out of its 143 GiB at step 151 (the two others held 125 GiB after; lease 1's three, at ~50-140
# steps, had fit). Three a GPU need the sharing OVERRIDES of docs/results/smollm2_study300/README.md (lease 2).
#
# GATE: pipeline (default) or off. With pipeline, the sweeps wait, after their SFTs, for $WORK/gate.txt
# (smollm2_sweep.sh's WAIT_FOR); once every sweep is ready (or has exited), the job times 3 PPO steps of the SPA arm
# (benchmarks/smollm2_step.py from the wm sweep's SFT checkpoint, spa_s0's overrides, add_worldmodel) once for each
# line of GATE_VARIANTS (default gate_variants.txt beside this file: "<name> <overrides>", the first the baseline),
# one after the other on the otherwise idle GPU; every arm gets the fastest variant's overrides if its step took
# at least 10% less than the baseline's (the decision, the steps' and their gen's seconds in progress.txt; the
# benchmarks' logs and JSON in out/gate_<name>.*). On several GPUs the variants are timed side by side, variant k
# on GPU k mod GPUs (the baseline on GPU 0), one benchmark at a time a GPU. A variant with an override of GPU_TESTS
# (below: generator.reuse_prefix_cache=true, ...) runs only after that code's GPU test passed here
# (out/gate_gpu_test_<file>.log); the tests run in the background on the last GPU from the job's start, while the
# data and the SFTs are made, with those of the decoder every arm uses for the record. A failed variant is left out;
# no wm sweep among the arms, no SFT checkpoint or no timing of the baseline: every arm with the baseline. Every arm,
# the Vanilla RL ones too, then starts after both SFTs and the timing (~1 minute a variant). off: no timing, every
# arm with the baseline (the config's defaults) as soon as its sweep is ready (Vanilla RL at once).
#
# Relay (docs/relay.md): runs longer than a lease, carried from lease to lease as LoRA adapters. DEADLINE (epoch
# seconds by which every arm must have stopped with a checkpoint) turns it on; it needs GATE=off (a run resumes only
# with the same settings, and the gate could choose others next time) and arms that save slim LoRA checkpoints
# (ARMS_FILE, e.g. docs/results/smollm2_relay/arms.txt). The SFTs run with trainer.deterministic=true (the next lease
# remakes them and resumes over them only if their weights are the same bytes), after the GPU test of that
# (tests/sft/test_sft_determinism.py; if it fails, without the switch); the sweeps continue runs (RESUME=1).
# Once the SFTs are done, the runs carried in (RELAY_IN, default $WORK/relay_in: relay.json and its parts) are
# unpacked where their sweeps continue them (SPA_agent.runs.relay checks the SFT's bytes first; a mismatch starts
# the arms afresh and says so in progress.txt), and every arm gets trainer.max_wall_s so that it stops at
# DEADLINE - MARGIN (default 150 s: the last step, a validation and the save). When the arms have stopped, their newest
# checkpoints and records are packed into RELAY_OUT (default $WORK/relay_out), parts of 15 MiB that relay_collect.sh
# hands out four a call.
#
# CONFIG: the entry config of every sweep, _2_sokoban (SimpleSokoban, default) or _3_frozen_lake (FrozenLake 4x4); a
# name without config/<name>.yaml is one line and exit status 2. The runs go to table2_<start>/ppo/$CONFIG/<arm>
# (collect.sh's tarball and printout take every config's); the gate times the SPA arm on CONFIG too. On FrozenLake
# SmolLM2's rollouts get 320 new tokens a turn, not the preset's 256 (smollm2_sweep.sh says why).
#
# GPU tests: the decoder every arm uses has its GPU tests run for the record (RECORD_GPU_TESTS below), and so have
# the gate's variants (GPU_TESTS), with either GATE, in the background on the last GPU from the job's start (before
# the conversion), while the data and SFTs are made; only with GATE=pipeline do the variants' tests gate anything.
# KERNEL_BENCH=1 first times the decode attention kernels (benchmarks/decode_attention_kernels.py, with
# KERNEL_BENCH_ARGS, e.g. "--finished 0.6 0.9") there, under KERNEL_BENCH_S (120) seconds (kernel_bench below); a
# sweep whose first GPU (its SFT's, or a Vanilla RL arm's) is the last GPU starts after it, so that no other work
# blurs the timings (that sweep's arms start up to ~1.5 minutes later). The GPU tests wait for it too.
#
# WM_EVAL=1: the wm sweep evaluates each of its arms' last checkpoint in the SFT's own prompts (smollm2_sweep.sh's
# WM_EVAL): the world model's accuracy after a PPO that ran in base prompts, in table2_wm/wm_eval/ (collect.sh takes
# it); before PPO, it is the step-0 validation of an arm in add_worldmodel prompts. ~15 s of the arm's GPU, after it.
#
# Settings for a CPU check of the plumbing: MODEL=tiny STEPS=2 TEST_FREQ=1, OVERRIDES (added to every arm's, e.g.
# shorter answers), SFT_OVERRIDES (the sweep's), REPO (the tree, /tmp/repo), WORK (where results go, /tmp) and
# GATE_ARGS (more arguments of the gate's step benchmark: --smoke on CPU, which times the tiny model instead);
# GATE_PROFILE adds arguments to the gate's baseline benchmark alone (--profile gen: one more rollout under torch's
# profiler, its operator tables in out/gate_<baseline>.log; ~30 s more).
REPO="${REPO:-/tmp/repo}"; WORK="${WORK:-/tmp}"; O="$WORK/out"
export PYTHONPATH="/tmp/site:$REPO" SPA_SMOLLM2_GGUF=/tmp/smol.gguf PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0 PATH="/tmp/site/bin:$PATH"
export MODEL="${MODEL:-smollm2-135m}"
mkdir -p "$O"
p() { echo "$(date -u +%T) $*" >> "$O/progress.txt"; }
cd "$REPO" || exit 1
HERE=docs/results/smollm2_table2
nvidia-smi > "$O/gpu.txt" 2>&1
N=$(nvidia-smi --list-gpus 2>/dev/null | grep -c GPU)

# The arms of this lease, each with its GPU (none on a CPU host).
GATE="${GATE:-pipeline}"
case "$GATE" in pipeline|off) ;; *) echo "error: GATE must be pipeline or off, got '$GATE'" >&2; exit 2 ;; esac
if [ -n "${CONFIG:-}" ] && [ ! -f "config/$CONFIG.yaml" ]; then  # (the default is the tree's own)
    echo "error: unknown CONFIG '$CONFIG' (no config/$CONFIG.yaml); choose _2_sokoban or _3_frozen_lake" >&2; exit 2
fi
export CONFIG="${CONFIG:-_2_sokoban}"
CONFIG_PPO=""  # the rollouts' length smollm2_sweep.sh gives every FrozenLake arm, for the gate's step benchmark
[ "$CONFIG:$MODEL" = _3_frozen_lake:smollm2-135m ] && CONFIG_PPO="actor_rollout_ref.rollout.response_length=320"
case "${ARMS_PER_GPU:-2}" in
    ""|0|*[!0-9]*) echo "error: ARMS_PER_GPU takes a number >= 1, got '$ARMS_PER_GPU'" >&2; exit 2 ;;
esac
ARMS_FILE="${ARMS_FILE:-$HERE/arms.txt}"
[ -f "$ARMS_FILE" ] || { echo "error: ARMS_FILE $ARMS_FILE does not exist" >&2; exit 2; }
GATE_VARIANTS="${GATE_VARIANTS:-$HERE/gate_variants.txt}"
[ -f "$GATE_VARIANTS" ] || { echo "error: GATE_VARIANTS $GATE_VARIANTS does not exist" >&2; exit 2; }
RELAY_IN="${RELAY_IN:-$WORK/relay_in}"; RELAY_OUT="${RELAY_OUT:-$WORK/relay_out}"; MARGIN="${MARGIN:-150}"
if [ -n "${DEADLINE:-}" ]; then
    case "$DEADLINE$MARGIN" in *[!0-9]*) echo "error: DEADLINE and MARGIN take whole seconds" >&2; exit 2 ;; esac
    [ "$GATE" = off ] || { echo "error: a relay (DEADLINE) needs GATE=off: a run resumes only with the same settings" >&2; exit 2; }
    export RESUME=1 SFT_OVERRIDES="${SFT_OVERRIDES:-} trainer.deterministic=true"
fi
ALL="$(grep -v '^#' "$ARMS_FILE")"
declare -A PLACED  # arm -> the GPU ARMS gives it (name@gpu)
if [ -n "${ARMS:-}" ]; then
    names=""
    for entry in $ARMS; do
        name="${entry%%@*}"
        grep -q "^$name " <<< "$ALL" || { echo "error: ARMS names '$name', not an arm of $ARMS_FILE" >&2; exit 2; }
        if [ "$entry" != "$name" ]; then
            gpu="${entry#*@}"
            case "$gpu" in ""|*[!0-9]*) echo "error: ARMS: '$entry' takes a GPU's number after the @" >&2; exit 2 ;; esac
            [ "$N" -eq 0 ] || [ "$gpu" -lt "$N" ] \
                || { echo "error: ARMS: '$entry' names GPU $gpu, but this host has $N (0-$(( N - 1 )))" >&2; exit 2; }
            PLACED[$name]="$gpu"
        fi
        names+="$name "
    done
    CHOSEN="$(grep -E "^($(echo $names | tr ' ' '|')) " <<< "$ALL")"  # in the file's order
elif [ "$N" -gt 0 ]; then
    CHOSEN="$(head -n $(( N * ${ARMS_PER_GPU:-2} )) <<< "$ALL")"
else
    CHOSEN="$ALL"
fi
COUNT=$(grep -c . <<< "$CHOSEN")
threads=$(( $(nproc) / (COUNT + 2) )); export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))  # arms + 2 SFTs
p "config=$CONFIG gpus=$N arms=$(cut -d' ' -f1 <<< "$CHOSEN" | tr '\n' ' ')OMP_NUM_THREADS=$OMP_NUM_THREADS"
# One sweep per start: its arms' lines ("<name> <overrides>") and their GPUs, in priority order.
i=0
declare -A SETTINGS GPU_IDS
while read -r name start overrides; do
    SETTINGS[$start]+="$name $overrides ${OVERRIDES:-}"$'\n'
    [ "$N" -gt 0 ] && GPU_IDS[$start]+="${PLACED[$name]:-$(( i % N ))} "
    i=$(( i + 1 ))
done <<< "$CHOSEN"
# Each sweep's SFT runs on its first GPU: the nowm (then nopred, nostate) sweep's list starts at a GPU where no earlier
# sweep's SFT runs, where it has one (on two GPUs, ARMS="spa_s1 spa_s2 format_s1 format_s2" would put both SFTs on
# GPU 0), the same arms a GPU.
wm_gpus="${GPU_IDS[wm]:-}"; sft_gpus=" ${wm_gpus%% *} "
for start in nowm nopred nostate; do
    [ -n "${GPU_IDS[$start]:-}" ] || continue
    read -ra ids <<< "${GPU_IDS[$start]}"
    for k in "${!ids[@]}"; do
        if [[ "$sft_gpus" != *" ${ids[$k]} "* ]]; then GPU_IDS[$start]="${ids[*]:$k} ${ids[*]:0:$k}"; break; fi
    done
    sft_gpus+="${GPU_IDS[$start]%% *} "
done
# Overrides whose code has a GPU test (`pytest -k gpu <file>`) that must pass on this host before the gate times a
# variant with them: however fast, a kernel that computes the wrong numbers must not reach the arms.
declare -A GPU_TESTS=(
    ["generator.reuse_prefix_cache=true"]=tests/generators/test_reused_prefix_cache.py
    ["actor_rollout_ref.model.liger_training=true"]=tests/trainer/test_liger_training.py
    ["generator.decode_attention=split_kv"]=tests/generators/test_split_kv_decode.py
    ["generator.decode_attention=split_kv_shared"]=tests/generators/test_shared_prefix_decode.py
    ["generator.fused_projections=true"]=tests/generators/test_fused_projections.py
    ["actor_rollout_ref.rollout.compact_decode_rows=16"]=tests/generators/test_compact_decode.py
)
# The decoder every arm uses (its CUDA graphs and the end-of-turn watch; SmolLM2's shared-prefix attention and fused
# projections): its GPU tests run for the record (the progress line says whether they passed); they gate nothing.
RECORD_GPU_TESTS="tests/generators/test_static_decode.py tests/generators/test_shared_prefix_decode.py
    tests/generators/test_fused_projections.py"
# gpu_test FILE: its GPU tests, once, on the last GPU; passed or failed (also a file the tree lacks) into
# out/gate_gpu_test_<file>.result.
gpu_test() {
    local log="$O/gate_gpu_test_$(basename "$1" .py).log" result=failed
    if [ ! -f "$1" ]; then
        echo "$1: no such test file in this tree" > "$log"
    elif CUDA_VISIBLE_DEVICES=$(( N - 1 )) python -m pytest -q -p no:cacheprovider -k gpu "$1" > "$log" 2>&1 < /dev/null \
            && grep -q " passed" "$log" && ! grep -q -e " failed" -e " error" "$log"; then
        result=passed
    fi
    echo "$result" > "${log%.log}.result"
}
# kernel_bench: with KERNEL_BENCH=1, the decode attention kernels' benchmark (benchmarks/decode_attention_kernels.py:
# the split-KV kernels' launch parameters at SmolLM2's decode shapes, issue 42) on the last GPU, stopped after
# KERNEL_BENCH_S (120) seconds; out/decode_attention.*.
kernel_bench() {
    { [ "${KERNEL_BENCH:-0}" = 1 ] && [ "$N" -gt 0 ]; } || return 0
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$(( N - 1 )) timeout "${KERNEL_BENCH_S:-120}" python benchmarks/decode_attention_kernels.py \
        --json "$O/decode_attention.jsonl" ${KERNEL_BENCH_ARGS:-} > "$O/decode_attention.log" 2>&1 < /dev/null
    p "the decode attention kernels' benchmark rc=$? (124: stopped at KERNEL_BENCH_S; out/decode_attention.*)"
}
# The background GPU work starts at once, before the conversion, on the last GPU: the kernels' benchmark (if asked
# for; BENCH_DONE once it has ended), then the GPU tests one file after the other (the gate's variants' and the
# decoder's), while the data and the SFTs are made (the wm sweep's SFT runs on GPU 0), so that the gate need not
# wait for them (lease 5: ~45 s).
GPU_TESTS_PID=""; BENCH_DONE="$O/kernel_bench.done"; rm -f "$BENCH_DONE"
if [ "$N" -gt 0 ]; then
    (
        kernel_bench
        touch "$BENCH_DONE"
        variant_tests=$(for override in $(grep -v '^#' "$GATE_VARIANTS" | cut -s -d' ' -f2-); do
                            echo "${GPU_TESTS[$override]:-}"; done | sort -u)
        for file in $( (echo "$variant_tests"; tr ' ' '\n' <<< "$RECORD_GPU_TESTS") | sort -u); do
            gpu_test "$file"
        done
        for file in $RECORD_GPU_TESTS; do
            log="$O/gate_gpu_test_$(basename "$file" .py).log"
            p "the GPU tests of $file (the decoder every arm uses; they gate nothing) $(cat "${log%.log}.result"): $(tail -n 1 "$log")"
        done
        if [ "$GATE" = off ]; then  # (with the gate, its own lines say how its variants' tests went)
            for file in $variant_tests; do
                [[ " $RECORD_GPU_TESTS " == *" $file "* ]] && continue
                log="$O/gate_gpu_test_$(basename "$file" .py).log"
                p "the GPU tests of $file (a gate variant's; no gate here, for the record) $(cat "${log%.log}.result"): $(tail -n 1 "$log")"
            done
        fi
    ) &
    GPU_TESTS_PID=$!
fi
declare -A GPU_TEST_RESULT  # file -> passed | failed (each file's line in progress.txt once)
# gpu_tested OVERRIDES: whether every GPU test the variant's overrides need passed here (no GPU: none did).
gpu_tested() {
    local override file log
    for override in $1; do
        file="${GPU_TESTS[$override]:-}"
        [ -n "$file" ] || continue
        if [ -z "${GPU_TEST_RESULT[$file]:-}" ]; then
            log="$O/gate_gpu_test_$(basename "$file" .py).log"
            while [ ! -e "${log%.log}.result" ] && [ -n "$GPU_TESTS_PID" ] && kill -0 "$GPU_TESTS_PID" 2>/dev/null; do
                sleep 1
            done
            GPU_TEST_RESULT[$file]=$(cat "${log%.log}.result" 2>/dev/null || echo failed)
            p "gate: the GPU test of $override ${GPU_TEST_RESULT[$file]}: $(tail -n 1 "$log" 2>/dev/null || echo no GPU)"
        fi
        [ "${GPU_TEST_RESULT[$file]}" = passed ] || return 1
    done
}

if [ "$MODEL" = smollm2-135m ]; then python -m SPA_agent.smollm2 > "$O/convert.log" 2>&1; p "convert rc=$?"; fi
if [ -n "${DEADLINE:-}" ] && [ "$N" -gt 0 ]; then  # a relay's SFTs must repeat bit for bit: first see that they do here
    python -m pytest -q -s -p no:cacheprovider tests/sft/test_sft_determinism.py -k gpu > "$O/determinism.log" 2>&1
    if grep -q "1 passed" "$O/determinism.log"; then
        p "relay: the deterministic SFT repeats on this GPU: $(grep -h -e '^without' -e '^step seconds' "$O/determinism.log" | tr '\n' ' ')"
    else
        SFT_OVERRIDES="${SFT_OVERRIDES% trainer.deterministic=true}"
        p "relay: the deterministic SFT did NOT repeat or failed on this GPU (out/determinism.log): SFTs without the switch, so no run of this lease can be continued"
    fi
fi

# Checkpoints only at the end (nothing returns them), but every validation in a relay: an arm that fails has one to carry.
SAVE_FREQ=0; [ -n "${DEADLINE:-}" ] && SAVE_FREQ="${TEST_FREQ:-25}"
GATE_FILE="$WORK/gate.txt"; rm -f "$GATE_FILE" "$WORK"/table2_*/logs/ready  # none of an earlier job's
WAIT_FOR=""; { [ "$GATE" = pipeline ] || [ -n "${DEADLINE:-}" ]; } && WAIT_FOR="$GATE_FILE"
declare -A SWEEP_PID
for start in wm nowm nopred nostate base; do
    [ -n "${SETTINGS[$start]:-}" ] || continue
    p "sweep $start on GPUs ${GPU_IDS[$start]:-none}: $(cut -d' ' -f1 <<< "${SETTINGS[$start]%$'\n'}" | tr '\n' ' ')"
    (
        if [ "${KERNEL_BENCH:-0}" = 1 ] && [ "${GPU_IDS[$start]%% *}" = "$(( N - 1 ))" ]; then  # after the benchmark
            while [ ! -e "$BENCH_DONE" ] && kill -0 "$GPU_TESTS_PID" 2>/dev/null; do sleep 1; done
        fi
        wm_eval=0; [ "$start" = wm ] && wm_eval="${WM_EVAL:-0}"  # the world model only where an SFT taught it
        WM_EVAL=$wm_eval START=$start GENERATOR=random MODE=base STEPS="${STEPS:-300}" TEST_FREQ="${TEST_FREQ:-25}" \
            VAL_SAMPLES=4 SAVE_FREQ="$SAVE_FREQ" GPU_IDS="${GPU_IDS[$start]:-}" OUT="$WORK/table2_$start" SETTINGS="${SETTINGS[$start]%$'\n'}" \
            WAIT_FOR="$WAIT_FOR" bash benchmarks/smollm2_sweep.sh > "$O/sweep_$start.out" 2>&1
        p "sweep $start rc=$?"
    ) &
    SWEEP_PID[$start]=$!
done

# gate FILE: into FILE every arm's extra overrides, one line (empty: the baseline's, GATE_VARIANTS' first line), from
# timing the SPA arm's PPO step with each variant; its decision into progress.txt. A variant whose benchmark fails
# is left out; without the baseline's timing the gate is empty.
gate() {
    local file="$1" ready="$WORK/table2_wm/logs/ready" name overrides profile="${GATE_PROFILE:-}"
    : > "$file"
    if [ -z "${SWEEP_PID[wm]:-}" ]; then p "gate: no wm sweep among the arms, no timing: the baseline"; return; fi
    if [ ! -s "$ready" ]; then p "gate: the wm sweep exited before its SFT was done: the baseline"; return; fi
    local names=() lines=() pids=() gpu k
    while read -r name overrides; do
        if ! gpu_tested "$overrides"; then
            p "gate: $name left out: a GPU test its overrides need did not pass (out/gate_gpu_test_*.log)"; continue
        fi
        names+=("$name"); lines+=("$overrides")
    done < <(grep -v -e '^#' -e '^[[:space:]]*$' "$GATE_VARIANTS")
    # variant k on GPU k mod N (one after the other on each GPU, the GPUs side by side); the baseline alone profiled
    for (( gpu = 0; gpu < (N > 0 ? N : 1); gpu++ )); do
        (
            for (( k = gpu; k < ${#names[@]}; k += (N > 0 ? N : 1) )); do
                [ "$k" -eq 0 ] || profile=""
                # shellcheck disable=SC2046,SC2086
                CUDA_VISIBLE_DEVICES=$gpu python benchmarks/smollm2_step.py --model-path "$(cat "$ready")" --steps 3 \
                    --no-val --json "$O/gate_${names[$k]}.json" --config "$CONFIG" ${GATE_ARGS:-} $profile $CONFIG_PPO \
                    $(grep '^spa_s0 ' <<< "$ALL" | cut -d' ' -f3-) ${OVERRIDES:-} ${lines[$k]} \
                    > "$O/gate_${names[$k]}.log" 2>&1 \
                    || p "gate: the step benchmark failed (${names[$k]}, rc=$?, GPU $gpu): left out"
            done
        ) &
        pids+=($!)
    done
    wait "${pids[@]}"
    p "$(python - "$O" "$file" "$GATE_VARIANTS" <<'PY'
import json, sys
from pathlib import Path
out, gate, variants = sys.argv[1:4]
lines = [line.split(maxsplit=1) for line in Path(variants).read_text().splitlines()
         if line.strip() and not line.startswith("#")]
overrides = {words[0]: words[1] if len(words) > 1 else "" for words in lines}
baseline = lines[0][0]
steps = {}
for name in overrides:
    path = Path(out) / f"gate_{name}.json"
    if path.exists():
        steps[name] = [r for r in json.loads(path.read_text()) if r["metric"] == "summary"][0]
others = [name for name in steps if name != baseline]
chosen = baseline
if baseline in steps and others:
    best = min(others, key=lambda name: steps[name]["total"])
    if steps[best]["total"] <= 0.9 * steps[baseline]["total"]:  # >= 10% less
        chosen = best
open(gate, "w").write((overrides[chosen] if baseline in steps else "") + "\n")
print("gate: a step (its gen) " + ", ".join(f"{name} {step['total']} s ({step['timing_s/gen']} s)"
                                             for name, step in steps.items())
      + (f": {chosen}" if baseline in steps else f": no timing of the baseline ({baseline}), so the baseline"))
PY
)"
}

# relay_in: the carried runs unpacked where their sweeps will continue them (nothing to do without RELAY_IN).
relay_in() {
    if [ ! -e "$RELAY_IN/relay.json" ]; then p "relay: nothing carried in ($RELAY_IN): every arm starts at step 0"; return; fi
    if python -m SPA_agent.runs.relay unpack "$RELAY_IN" --root "$WORK" > "$O/relay_in.log" 2>&1; then
        p "relay: carried in: $(tr '\n' ';' < "$O/relay_in.log")"
    else
        p "relay: NOT carried in, every arm starts at step 0: $(tail -n 1 "$O/relay_in.log")"
    fi
}

if [ -n "$WAIT_FOR" ]; then
    for start in "${!SWEEP_PID[@]}"; do  # every sweep ready, or exited (a failed one must not hold the others)
        while [ ! -e "$WORK/table2_$start/logs/ready" ] && kill -0 "${SWEEP_PID[$start]}" 2>/dev/null; do sleep 1; done
    done
    p "gate: sweeps ready: $(cd "$WORK" && ls table2_*/logs/ready 2>/dev/null | cut -d/ -f1 | tr '\n' ' ')"
    if [ "$GATE" = pipeline ]; then gate "$GATE_FILE.tmp"; else : > "$GATE_FILE.tmp"; fi
    if [ -n "${DEADLINE:-}" ]; then
        relay_in
        wall=$(( DEADLINE - $(date +%s) - MARGIN ))
        echo "trainer.max_wall_s=$(( wall > 0 ? wall : 0 ))" >> "$GATE_FILE.tmp"
    fi
    mv "$GATE_FILE.tmp" "$GATE_FILE"  # whole, so that no sweep reads half of it
    p "gate: every arm's extra overrides: '$(tr '\n' ' ' < "$GATE_FILE")'"
fi
wait
p "sweeps done"
if [ -n "${DEADLINE:-}" ]; then  # every run with a checkpoint, for the next lease
    runs=$(cd "$WORK" && for run in table2_*/ppo/"$CONFIG"/*/; do
        [ -e "$run/latest_checkpointed_iteration.txt" ] && echo "${run%/}"; done)
    # shellcheck disable=SC2086
    if [ -n "$runs" ] && python -m SPA_agent.runs.relay pack --root "$WORK" --out "$RELAY_OUT" $runs \
            > "$O/relay_out.log" 2>&1; then
        p "relay: packed: $(tr '\n' ';' < "$O/relay_out.log")"
    else
        p "relay: nothing packed: $(tail -n 1 "$O/relay_out.log" 2>/dev/null || echo no run has a checkpoint)"
    fi
fi

# Shared helpers of run_spa.sh, run_baseline.sh and train_ppo_sfted.sh (sourced, not executed).

SPA_CONFIGS="_2_sokoban _3_frozen_lake _10_sudoku"
# The scripts stay in the caller's directory, so that relative paths (arguments, OUTPUT_DIR, overrides) mean what
# they mean there; they find their repository by its path, and run its code whatever the directory.
SPA_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$SPA_REPO${PYTHONPATH:+:$PYTHONPATH}"

die() { echo "error: $*" >&2; exit 2; }

# check_config NAME: fail clearly on an unknown entry config.
check_config() {
    local name="$1" known
    for known in $SPA_CONFIGS; do [ "$name" = "$known" ] && return 0; done
    [ -f "$SPA_REPO/config/$name.yaml" ] && return 0
    die "unknown config '$name'; choose one of: $SPA_CONFIGS"
}

# is_resume: RESUME=1 continues the runs in the output directories when their settings match (run_identity.json;
# a mismatch is refused, naming the keys); RESUME=0, the default, starts every stage fresh there.
is_resume() {
    case "${RESUME:-0}" in
        1|true|True) return 0 ;;
        0|false|False) return 1 ;;
        *) die "RESUME must be 0 (fresh run, the default) or 1 (continue a matching run), got '$RESUME'" ;;
    esac
}

# check_count NAME MIN: when the variable NAME is set, it must be an integer >= MIN.
check_count() {
    local name="$1" min="$2" value="${!1:-}"
    [ -z "$value" ] && return 0
    [[ "$value" =~ ^[0-9]+$ ]] && [ "$value" -ge "$min" ] \
        || die "$name must be an integer >= $min, got '$value'"
}

# check_script_variables: every environment variable the scripts read as a number (and RESUME), checked before
# any stage runs, so a typo is one line, not an unbound variable after the dataset was written.
check_script_variables() {
    check_count NGPUS 0
    check_count BT_NUM 1
    check_count TOTAL_STEPS 1
    case "${ROLLOUT_TP:-auto}" in
        auto|[1-9]|[1-9][0-9]) ;;
        *) die "ROLLOUT_TP must be auto or an integer >= 1, got '$ROLLOUT_TP'" ;;
    esac
    is_resume || true
}

# model_settings SIZE: the model-size table's row of MODEL=SIZE (SPA_agent/model_presets.py) as shell variables:
# MODEL_PRESET (Hydra model preset), MODEL_FAMILY (in checkpoint directory names), MODEL_SFT_MODEL,
# MODEL_SFT_FAMILY, MODEL_SFT_MAX_LENGTH, MODEL_SFT_DEFAULTS, MODEL_DATA_GENERATOR, MODEL_DATA_BATCHES,
# MODEL_PPO_STEPS, MODEL_IN_PAPER (1 or empty), and NAMED_MODELS (model_path names that are built, not paths).
# An unknown SIZE is one line and exit status 2.
model_settings() {
    local settings
    settings="$(python -m SPA_agent.model_presets shell "$1")" || exit 2
    eval "$settings"
}

# stage_command STAGE FLAGS... [-- overrides...]: the python arguments of one stage, one a line, from the stage
# definition (SPA_agent/stages.py, `python -m SPA_agent.stages --help`); an unknown MODEL is one line, exit status 2.
stage_command() { python -m SPA_agent.stages "$@" || exit 2; }

# script_names FLAGS...: the folders of a script's run as shell variables (DEFAULT_OUTPUT_DIR,
# DEFAULT_CHECKPOINT_DIR, EXPERIMENT_NAME, RUN_DIR, DEFAULT_EVAL_DIR), from the stage definition.
script_names() {
    local names
    names="$(python -m SPA_agent.stages names "$@")" || exit 2
    eval "$names"
}

# gpu_count: visible CUDA devices (CUDA_VISIBLE_DEVICES if set, else nvidia-smi), 0 without CUDA.
gpu_count() {
    if [ -n "${NGPUS:-}" ]; then echo "$NGPUS"; return; fi
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --list-gpus 2>/dev/null | grep -c GPU || true
    else
        echo 0
    fi
}

# latest_checkpoint DIR: the global_step_N sub-directory with the highest N (only those count).
latest_checkpoint() {
    local dir="$1" best="" best_n=-1 d n
    [ -d "$dir" ] || die "checkpoint directory '$dir' does not exist (run with generate_data=True, or download an SFT checkpoint into it)"
    for d in "$dir"/global_step_*; do
        [ -d "$d" ] || continue
        n="${d##*global_step_}"
        [[ "$n" =~ ^[0-9]+$ ]] || continue
        if [ "$n" -gt "$best_n" ]; then best_n="$n"; best="$d"; fi
    done
    [ -n "$best" ] || die "no global_step_N checkpoint in '$dir'"
    echo "$best"
}

# default_generator: vllm when importable, else hf (for evaluation and data generation with a real model).
default_generator() {
    if python -c "import vllm" >/dev/null 2>&1; then echo vllm; else echo hf; fi
}

# load_experiment PIPELINE CONFIG OVERRIDES...: set EXPERIMENT, EXP_ARGS, EXP_RENDER_MODE, EXP_MODEL,
# EXP_DATA_GENERATOR, EXP_DATA_SUFFIX, EXP_SFT_SUFFIX, EXP_SFT_OVERRIDES from the experiment named by an
# `experiment=<name>` override (else the script's default for RENDER_MODE); see SPA_agent/experiments.py.
load_experiment() {
    local pipeline="$1" config="$2" settings
    shift 2
    settings="$(python -m SPA_agent.experiments settings --render-mode "${RENDER_MODE:-}" "$pipeline" "$config" -- "$@")" \
        || exit 2
    eval "$settings"
}

# run_stage ARGS...: `python ARGS...`, a stage's entry point; with SPA_PRINT_STAGE=1 its arguments are printed
# instead, one a line, for check_stages.
run_stage() { if [ -n "${SPA_PRINT_STAGE:-}" ]; then printf '%s\n' "$@"; else python "$@"; fi; }

# check_stages STAGE...: each STAGE the python arguments of one stage, one a line (what run_stage prints); every
# stage's config composed and checked by its own checks in one process (SPA_agent/pipeline_check.py), before the
# first stage runs: a setting only a later stage reads is one line, not a failure after the earlier stages.
check_stages() {
    local args=() stage lines
    for stage in "$@"; do
        mapfile -t lines <<< "$stage"
        [ ${#args[@]} -eq 0 ] || args+=(--then)
        args+=("${lines[@]}")
    done
    python -m SPA_agent.pipeline_check "${args[@]}"
}

# evaluation_args CONFIG MODEL_PATH OUT_DIR GENERATOR [overrides...]: the python arguments of one evaluation of
# evaluate_before_after, one a line. Reads MODEL and RENDER_MODE.
evaluation_args() {
    local config="$1" model_path="$2" out_dir="$3" generator="$4"
    shift 4
    stage_command evaluation --config="$config" --model-size="$MODEL" --model-path="$model_path" \
        --output-dir="$out_dir" --render-mode="$RENDER_MODE" --generator="$generator" -- "$@"
}

# evaluate_before_after CONFIG BEFORE_MODEL RUN_DIR EVAL_DIR [overrides...]: evaluate BEFORE_MODEL and the final
# actor of the PPO run RUN_DIR into EVAL_DIR/{before_ppo,after_ppo}, then write EVAL_DIR/summary.md (our rows
# beside the paper's); a rerun replaces the evaluations there (evaluation.overwrite=true). Reads MODEL and RENDER_MODE.
evaluate_before_after() {
    local config="$1" before="$2" run_dir="$3" eval_dir="$4" generator final which model_path text args
    shift 4
    generator="$(default_generator)"
    final="$(latest_checkpoint "$run_dir")/actor"
    echo "== evaluation ($generator): before PPO ($before) and after PPO ($final) -> $eval_dir"
    for which in before_ppo after_ppo; do
        model_path="$before"; [ "$which" = after_ppo ] && model_path="$final"
        text="$(evaluation_args "$config" "$model_path" "$eval_dir/$which" "$generator" "$@")"
        mapfile -t args <<< "$text"
        python "${args[@]}"
    done
    text="$(stage_command report --eval-dir="$eval_dir" --run-dir="$run_dir" --model-size="$MODEL")"
    mapfile -t args <<< "$text"
    python "${args[@]}"
}

# print_ppo_outputs RUN_DIR EVAL_DIR: the closing lines shared by run_spa.sh and run_baseline.sh.
print_ppo_outputs() {
    cat <<OUTPUTS
   PPO run            $1  (metrics.jsonl, final actor $(latest_checkpoint "$1")/actor)
   evaluations        $2/{before_ppo,after_ppo}  (eval.json, trajectories.jsonl, passk.png)
   summary            $2/summary.md  (our numbers beside the paper's)
OUTPUTS
}

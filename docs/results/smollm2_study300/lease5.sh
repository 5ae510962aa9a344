#!/usr/bin/env bash
# Lease 5 on one H200 (README.md beside this file, "Lease 5"): issue 42's two open measurements first, on the fresh
# machine, then arms of the grpo_guard seeds through ../smollm2_table2/job.sh. The calling lease has joined the GGUF
# into /tmp/smol.gguf, installed the wheels into /tmp/site and copied the tree to /tmp/repo (job.sh's header), and
# starts this script with setsid from /tmp/repo.
#
#   BENCH=1 (default) first runs, one after the other on the idle GPU:
#     benchmarks/smollm2_step.sh /tmp/out/b42   the SFT epoch of the preset's recipe, data made there (issue 42)
#     benchmarks/ppo_step.py --model 0.5b       the 0.5B shape's step, 3 repeats, JSON in /tmp/out/ppo_0.5b.json
#   then job.sh with ARMS (required, e.g. "grpo_guard_s4@0 format_grpo_guard_s4@0") and the study's sharing
#   overrides; its progress goes to /tmp/out/progress.txt as in every lease.
set -uo pipefail
: "${ARMS:?ARMS names the arms of arms.txt this lease runs}"
export PYTHONPATH="/tmp/site:${PWD}" SPA_SMOLLM2_GGUF=/tmp/smol.gguf PATH="/tmp/site/bin:$PATH" \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/out
p() { echo "$(date -u +%T) $*" >> /tmp/out/progress.txt; }
if [ "${BENCH:-1}" = 1 ]; then
    p "bench: smollm2_step.sh (SFT epoch on the fresh machine)"
    SFT_OVERRIDES="$(python -m SPA_agent.model_presets lookup smollm2-135m sft_defaults) trainer.total_epochs=1" \
        bash benchmarks/smollm2_step.sh /tmp/out/b42 > /tmp/out/b42.log 2>&1
    p "bench: smollm2_step.sh rc=$? $(tr '\t\n' ' ;' < /tmp/out/b42/times.tsv)"
    python benchmarks/ppo_step.py --model 0.5b --repeats 3 --json /tmp/out/ppo_0.5b.json > /tmp/out/ppo_0.5b.log 2>&1
    p "bench: ppo_step.py --model 0.5b rc=$? $(grep -o '"seconds": [0-9.]*' /tmp/out/ppo_0.5b.log | tail -1)"
fi
WM_EVAL=1 GATE=off ARMS_FILE=docs/results/smollm2_study300/arms.txt \
    OVERRIDES="trainer.stop_after_uniform_scores=20 trainer.cuda_memory_fraction=0.3 generator.batch_size=256 generator.max_batch_tokens=null actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 critic.ppo_max_token_len_per_gpu=16384" \
    ARMS="$ARMS" REPO="$PWD" bash docs/results/smollm2_table2/job.sh

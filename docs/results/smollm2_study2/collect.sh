#!/usr/bin/env bash
# The lease's results so far into $OUT/study.tgz: job.sh's /tmp/out (progress, GPU tests, sweep logs) and each
# sweep's logs and PPO runs without checkpoints (metrics.jsonl, config.yaml, run_identity.json, ...), the data cards
# and the SFT's metrics. Run at the end of every polling call.
cd /tmp || exit 1
paths=(out)
for sweep in study_random study_solver; do
    for sub in logs ppo data/data_card.json data/data_card.md sft/metrics.jsonl sft/sft_config.yaml; do
        [ -e "$sweep/$sub" ] && paths+=("$sweep/$sub")
    done
done
tar czf "$OUT/study.tgz" --exclude='global_step_*' --exclude='*.pt' --exclude='*.safetensors' "${paths[@]}"
ls -la "$OUT/study.tgz"

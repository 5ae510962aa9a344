#!/usr/bin/env bash
# issue 42 lease: liger decode + finished-row skip + packed_sdpa SFT on one H200
set -x
export PYTHONPATH=/tmp/site:/tmp/repo SPA_SMOLLM2_GGUF=/tmp/smol.gguf PYTHONUNBUFFERED=1
cd /tmp/repo
W=/tmp/w; mkdir -p $W
nvidia-smi > $W/gpu.txt 2>&1
date +%s > $W/t0
# GPU tests of the changed decode paths
timeout 300 python -m pytest -q -p no:cacheprovider tests/generators/test_liger_decode.py tests/generators/test_static_decode.py > $W/gpu_tests.txt 2>&1
echo "gpu_tests rc=$?" >> $W/progress
# SFT packed_sdpa, step with liger (default), step without liger
SFT_OVERRIDES="model.attn_implementation=packed_sdpa" STEP_VARIANTS="noliger actor_rollout_ref.model.use_liger=false" \
  bash benchmarks/smollm2_step.sh $W/a "" --steps 4 > $W/a.out 2>&1
echo "a rc=$?" >> $W/progress
CKPT="$(ls -d $W/a/sft/global_step_* | sort -V | tail -1)"
# before the finished-row skip (d50dd29's decoder), no liger, no validation
rm -rf /tmp/repo_old && cp -r /tmp/repo /tmp/repo_old && cp .dev/static_decode_d50dd29.py /tmp/repo_old/SPA_agent/generators/static_decode.py
(cd /tmp/repo_old && PYTHONPATH=/tmp/site:/tmp/repo_old timeout 600 python benchmarks/smollm2_step.py --model-path "$CKPT" \
  --json $W/step_oldskip.json --steps 4 --no-val actor_rollout_ref.model.use_liger=false > $W/step_oldskip.log 2>&1)
echo "oldskip rc=$?" >> $W/progress
# 0.5B shape (random weights), with liger
timeout 600 python benchmarks/ppo_step.py --model 0.5b --repeats 3 --json $W/ppo05_liger.json \
  --override actor_rollout_ref.model.use_liger=true > $W/ppo05_liger.log 2>&1
echo "ppo05 liger rc=$?" >> $W/progress
timeout 600 python benchmarks/ppo_step.py --model 0.5b --repeats 3 --json $W/ppo05_plain.json > $W/ppo05_plain.log 2>&1
echo "ppo05 plain rc=$?" >> $W/progress
echo done >> $W/progress

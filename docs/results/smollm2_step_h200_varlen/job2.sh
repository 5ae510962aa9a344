#!/usr/bin/env bash
# Issue 42, the same lease as job.sh, after it: the tree with the packed attention's autocast fix (the passes run a
# float32 model under bf16 autocast, so the rotary step handed float32 queries to the attention and the varlen
# kernel never ran, which the GPU test caught). The GPU tests of the packing, the base model's step, an SFT epoch
# and the step from it, a profile of the passes, into /tmp/out2; the data of job.sh is reused.
export PYTHONPATH=/tmp/site:/tmp/repo2 SPA_SMOLLM2_GGUF=/tmp/smol.gguf PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PATH=/tmp/site/bin:$PATH
O=/tmp/out2; mkdir -p $O
p() { echo "$(date -u +%T) $*" >> $O/progress.txt; }
cd /tmp/repo2
while ! grep -q done /tmp/out/progress.txt; do sleep 2; done
timeout 300 python -m pytest -q -p no:cacheprovider -k gpu tests/trainer/test_packing.py > $O/gpu_tests.txt 2>&1
p "gpu tests rc=$?"
timeout 420 python benchmarks/smollm2_step.py --model-path smollm2-135m --steps 4 --json $O/base_step.json \
    > $O/base_step.log 2>&1
p "base step rc=$?"
SFT_OVERRIDES=model.attn_implementation=packed_sdpa SFT_TIMEOUT=400 STEP_TIMEOUT=420 \
    bash benchmarks/smollm2_step.sh $O/step /tmp/out/step/data --steps 4 > $O/step.out 2>&1
p "step.sh rc=$?"
CKPT="$(ls -d $O/step/sft/global_step_* | sort -V | tail -1)"
timeout 300 python benchmarks/smollm2_step.py --model-path "$CKPT" --steps 2 --no-val --profile train \
    > $O/profile_train.txt 2>&1
p "profile rc=$?"
rm -rf $O/step/sft
p done

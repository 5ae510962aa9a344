#!/usr/bin/env bash
# Issue 42, one nvidia-h200 lease: the GPU tests of the packed attention (flash attention's variable-length kernel)
# and the decoders, then the PPO step of the base model (the same benchmark as the split-KV row of
# benchmarks/RESULTS.md, for a before/after of the training passes), then benchmarks/smollm2_step.sh (an SFT epoch
# with packed attention, then the step from that checkpoint), then a profile of the training passes.
# The calling lease joins the SmolLM2 GGUF into /tmp/smol.gguf, installs the CPU wheels into /tmp/site and starts
# this script (setsid) from a copy of the tree in /tmp/repo.
export PYTHONPATH=/tmp/site:/tmp/repo SPA_SMOLLM2_GGUF=/tmp/smol.gguf PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PATH=/tmp/site/bin:$PATH
O=/tmp/out; mkdir -p $O
p() { echo "$(date -u +%T) $*" >> $O/progress.txt; }
cd /tmp/repo
nvidia-smi > $O/gpu.txt 2>&1
p convert; python -m SPA_agent.smollm2 > $O/convert.log 2>&1; p "convert rc=$?"
timeout 300 python -m pytest -q -p no:cacheprovider -k gpu tests/trainer/test_packing.py \
    tests/generators/test_split_kv_decode.py tests/generators/test_static_decode.py \
    tests/generators/test_liger_decode.py > $O/gpu_tests.txt 2>&1
p "gpu tests rc=$?"
timeout 420 python benchmarks/smollm2_step.py --model-path smollm2-135m --steps 4 --json $O/base_step.json \
    > $O/base_step.log 2>&1
p "base step rc=$?"
SFT_OVERRIDES=model.attn_implementation=packed_sdpa SFT_TIMEOUT=400 STEP_TIMEOUT=420 \
    bash benchmarks/smollm2_step.sh $O/step "" --steps 4 > $O/step.out 2>&1
p "step.sh rc=$?"
CKPT="$(ls -d $O/step/sft/global_step_* | sort -V | tail -1)"
timeout 300 python benchmarks/smollm2_step.py --model-path "$CKPT" --steps 2 --no-val --profile train \
    > $O/profile_train.txt 2>&1
p "profile rc=$?"
rm -rf $O/step/sft
p done

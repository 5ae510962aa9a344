#!/usr/bin/env bash
# Issues 43 and 42, one nvidia-h200-x4 lease. The SmolLM2 GGUF (three carried parts) is joined into /tmp/smol.gguf
# and the project's CPU wheels installed into /tmp/site by the call that starts this script (setsid) from /tmp/repo.
#   GPUs 0-1: the study's random-action data and SFT (benchmarks/smollm2_sweep.sh, SFT_GPUS=2), then its four arms
#             (arms.txt, the plan of docs/smollm2.md) one a GPU, base prompts, validation every 25 steps,
#             for as many of the 300 steps as the lease allows.
#   GPUs 2-3, while the data and SFT run: the decoder's GPU tests; the PPO step of the base model with the split-KV
#             decode attention (the default) and with flash attention's kernel, side by side; a profile of the
#             training passes.
export PYTHONPATH=/tmp/site:/tmp/repo SPA_SMOLLM2_GGUF=/tmp/smol.gguf PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
O=/tmp/out; mkdir -p $O
p() { echo "$(date -u +%T) $*" >> $O/progress.txt; }
cd /tmp/repo
HERE=docs/results/smollm2_study_h200x4
nvidia-smi > $O/gpu.txt 2>&1
p convert; python -m SPA_agent.smollm2 > $O/convert.log 2>&1; p "convert rc=$?"
(
    export CUDA_VISIBLE_DEVICES=3
    timeout 240 python -m pytest -q -p no:cacheprovider -k gpu tests/generators/test_split_kv_decode.py \
        tests/generators/test_static_decode.py tests/generators/test_liger_decode.py > $O/gpu_tests.txt 2>&1
    p "gpu tests rc=$?"
    timeout 420 python benchmarks/smollm2_step.py --model-path smollm2-135m --steps 4 --json $O/ab_flash.json \
        generator.decode_attention=flash > $O/ab_flash.log 2>&1
    p "ab flash rc=$?"
) &
(
    export CUDA_VISIBLE_DEVICES=2
    timeout 420 python benchmarks/smollm2_step.py --model-path smollm2-135m --steps 4 --json $O/ab_split_kv.json \
        > $O/ab_split_kv.log 2>&1
    p "ab split_kv rc=$?"
    timeout 420 python benchmarks/smollm2_step.py --model-path smollm2-135m --steps 2 --no-val --profile train \
        > $O/profile_train.txt 2>&1
    p "profile rc=$?"
) &
p sweep
MODE=base STEPS=300 TEST_FREQ=25 SAVE_FREQ=0 SFT_GPUS=2 OUT=/tmp/study SETTINGS="$(cat $HERE/arms.txt)" \
    bash benchmarks/smollm2_sweep.sh > $O/sweep.out 2>&1
p "sweep rc=$?"

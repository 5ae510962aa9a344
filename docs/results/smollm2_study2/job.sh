#!/usr/bin/env bash
# Issue 43's second study lease (and issue 42's checks), written for nvidia-h200-x4; on a two-GPU host each sweep
# keeps its first arm only (wm_gae and solver_wm_gae: both in the SFT's own prompts, random-action against solver data). The calling lease joins the SmolLM2 GGUF into /tmp/smol.gguf, installs the CPU wheels
# (ray included) into /tmp/site and starts this script (setsid) from a copy of the tree in /tmp/repo.
#   first, side by side: the GPU tests of the kept decode graphs and the packed attention (GPU 1), the conversion;
#   then two sweeps of benchmarks/smollm2_sweep.sh side by side, each its data and SFT on its first GPU, then its
#   arms one a GPU: random-action data on GPUs 0-1 (arms_random.txt: PPO in the SFT's own add_worldmodel prompts),
#   solver data on GPUs 2-3 (arms_solver.txt: PPO from the solver SFT in either prompt mode); validation every 25
#   steps on 128 x 4, for as many of the 300 steps as the lease allows. The arms keep their decode graphs
#   (generator.keep_decode_graphs=true) only where its GPU tests passed.
# The lease's calls (each carries at most 64 MiB; the GGUF split with `split -b 46M` and the wheels of
# scripts/offline_wheelhouse.sh, --slim-ray, in ignored folders of the tree):
#   1. carry gguf part aa and the first wheels: mkdir -p /tmp/p && cp <part aa> <wheels>/* /tmp/p/
#   2. carry part ab and the next wheels, the same way
#   3. carry part ac and ray's wheels, then: cat /tmp/p/<parts> > /tmp/smol.gguf (check its sha256),
#      pip install --no-index --no-deps --target /tmp/site /tmp/p/*.whl, cp -r "$PWD" /tmp/repo,
#      (setsid nohup bash /tmp/repo/docs/results/smollm2_study2/job.sh > /tmp/job.log 2>&1 &)
#   then calls that sleep and print /tmp/out/progress.txt, each ending with collect.sh (the results so far, without
#   checkpoints, into $OUT), so a lease that ends between two calls loses at most one call's steps.
export PYTHONPATH=/tmp/site:/tmp/repo SPA_SMOLLM2_GGUF=/tmp/smol.gguf PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0 PATH=/tmp/site/bin:$PATH
O=/tmp/out; mkdir -p $O
p() { echo "$(date -u +%T) $*" >> $O/progress.txt; }
cd /tmp/repo
HERE=docs/results/smollm2_study2
nvidia-smi > $O/gpu.txt 2>&1
N=$(nvidia-smi --list-gpus | grep -c GPU)
p "gpus=$N"
( python -m SPA_agent.smollm2 > $O/convert.log 2>&1; p "convert rc=$?" ) &
CUDA_VISIBLE_DEVICES=$(( N - 1 )) timeout 300 python -m pytest -q -p no:cacheprovider -k gpu \
    tests/generators/test_static_decode.py tests/trainer/test_packing.py > $O/gpu_tests.txt 2>&1
rc=$?; p "gpu tests rc=$rc"
wait
KEEP=""; [ $rc -eq 0 ] && KEEP="generator.keep_decode_graphs=true"
arms() { if [ "$N" -ge 4 ]; then sed "s/\$/ $KEEP/" "$1"; else head -1 "$1" | sed "s/\$/ $KEEP/"; fi; }
half=$(( N / 2 )); first=$(seq -s ' ' 0 $(( half - 1 ))); second=$(seq -s ' ' $half $(( N - 1 )))
p "sweeps: random on $first, solver on $second; keep=${KEEP:-off}"
MODE=base STEPS=300 TEST_FREQ=25 SAVE_FREQ=0 GENERATOR=random GPU_IDS="$first" OUT=/tmp/study_random \
    SETTINGS="$(arms $HERE/arms_random.txt)" bash benchmarks/smollm2_sweep.sh > $O/sweep_random.out 2>&1 &
MODE=base STEPS=300 TEST_FREQ=25 SAVE_FREQ=0 GENERATOR=solver GPU_IDS="$second" OUT=/tmp/study_solver \
    SETTINGS="$(arms $HERE/arms_solver.txt)" bash benchmarks/smollm2_sweep.sh > $O/sweep_solver.out 2>&1 &
wait
p "sweeps done"

#!/usr/bin/env bash
# Issue 46 lease (nvidia-h200-x4): the 1.5B shape (random weights, the tiny tokenizer), the paper's batch, verl on
# four GPUs first, then the local backend on one GPU, 5 PPO steps each, through benchmarks/backend_speed.sh.
# Wheels: vllm 0.24.0, verl 0.9.1, ray, hydra-core, omegaconf, gymnasium (scripts/offline_wheelhouse.sh with the
# skips of docs/scale_out.md), installed into one site folder, packed as tar.xz and carried in six parts, one per
# call, into /tmp/vxp; the call with the last part copies the tree to /tmp/repo and starts this script with setsid.
# The repeat (metrics_verl_repeat.jsonl) was a second call after this script ended: the same BACKENDS=verl line into
# another folder, with that folder holding a copy of metrics_local.jsonl for the table.
export PYTHONPATH=/tmp/site:/tmp/repo PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export SPA_VERL_TIME_CALLS=1 RAY_DEDUP_LOGS=0
O=/tmp/out; mkdir -p $O
p() { echo "$* $(date -u +%T)" >> $O/progress.txt; }
p start
cd /tmp/vxp && sha256sum -c vsite.sha > $O/sha.txt 2>&1 || { p "sha failed"; exit 1; }
mkdir -p /tmp/site
if command -v xz > /dev/null; then cat vsite.part-* | xz -dc -T0 | tar -x -C /tmp/site
else cat vsite.part-* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site')"
fi
p "site exit=$?"
cd /tmp/repo
python3 -c "import vllm, verl, ray, hydra, gymnasium; print(vllm.__version__, verl.__version__, ray.__version__)" > $O/imports.txt 2>&1
p "imports exit=$?"
nvidia-smi > $O/nvidia-smi.txt; nvidia-smi topo -m > $O/topo.txt 2>&1; lscpu > $O/lscpu.txt
W=/tmp/bs
p verl; BACKENDS=verl VERL_GPUS=4 WORK=$W bash benchmarks/backend_speed.sh $O/s 5 1.5b > $O/verl.out 2>&1; p "verl exit=$?"
grep -ah "spa worker seconds\|spa gc" $O/s/verl.log 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' > $O/s/worker_seconds.log
p local; BACKENDS=local WORK=$W bash benchmarks/backend_speed.sh $O/s 5 1.5b > $O/local.out 2>&1; p "local exit=$?"
python3 benchmarks/backend_table.py $O/s/metrics_local.jsonl $O/s/metrics_verl.jsonl \
    --labels "local (1 GPU)" "verl (4 GPUs)" > $O/s/table.md 2>&1
p done; echo done > $O/DONE

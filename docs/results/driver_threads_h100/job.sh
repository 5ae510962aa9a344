#!/usr/bin/env bash
# 2-GPU lease, session after stop 32 (issue 28): (A) both backends, 5 steps, defaults of commit e2fa5f3;
# (D) verl with verl_backend.separate_critic=true (critic passes beside the actor's); (B) verl with
# driver_cpu_threads=1. Carry the 8 vx parts one per call into /tmp/vxp, this script + vx.sha with part ah.
export PYTHONPATH=/tmp/site:/tmp/repo PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
O=/tmp/out; mkdir -p $O
p() { echo "$* $(date -u +%T)" >> $O/progress.txt; }
p start
cd /tmp/vxp && sha256sum -c vx.sha > $O/sha.txt 2>&1 || { p "sha failed"; exit 1; }
cat vx.tar.part-* | tar -xf - -C /tmp && p untarred
python -m pip install -q --no-index --no-deps --target /tmp/site /tmp/vx/*.whl > $O/pip.log 2>&1; p "pip exit=$?"
cd /tmp/repo; M=/tmp/bs/model_0.5b
(cd benchmarks && python random_model.py --shape 0.5b --out $M) > $O/model.log 2>&1; p "model exit=$?"
nvidia-smi > $O/nvidia-smi.txt; lscpu > $O/lscpu.txt
( while true; do echo "== $(date -u +%T)"; top -H -b -n 2 -d 1 -w 200 | awk '/^top -/{f++} f==2 && /^ *[0-9]/ && $9+0>=5' | head -40
  sleep 3; done >> $O/threads.txt 2>&1 ) &
SAMPLER=$!
B64=(ppo_max_token_len_per_gpu=65536 log_prob_max_token_len_per_gpu=65536)
export SPA_VERL_TIME_CALLS=1 RAY_DEDUP_LOGS=0
p A; WORK=/tmp/bs bash benchmarks/backend_speed.sh $O/A 5 0.5b -- "${B64[@]}" > $O/A.log 2>&1; p "A exit=$?"
for v in "D verl_backend.separate_critic=true" "B verl_backend.driver_cpu_threads=1"; do
  set -- $v; mkdir -p $O/$1; cp $O/A/metrics_local.jsonl $O/$1/
  p $1; BACKENDS=verl VERL_ARGS="$2" WORK=/tmp/bs bash benchmarks/backend_speed.sh $O/$1 5 0.5b -- "${B64[@]}" > $O/$1.log 2>&1
  p "$1 exit=$?"
done
kill $SAMPLER
for d in A D B; do grep -ah "spa worker seconds\|spa gc" $O/$d/verl*.log 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' > $O/$d/worker_seconds.log; done
p done; echo done > $O/DONE

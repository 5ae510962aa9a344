#!/usr/bin/env bash
# The results so far: /tmp/out into $OUT, and each step benchmark's last line (its summary when it is done).
cp -r /tmp/out/. "$OUT/" 2>/dev/null
cat /tmp/out/progress.txt
tail -n 3 /tmp/out/gpu_tests.log 2>/dev/null
for log in /tmp/out/step_*.log; do
    [ -e "$log" ] && { echo "== $log"; tail -n 1 "$log" | cut -c1-1500; }
done

#!/usr/bin/env bash
# The lease's results so far into $OUT/table2.tgz, run at the end of every polling call: job.sh's out/ (progress,
# sweep logs, the pipelining gate's step benchmarks), gate.txt (the overrides the gate gave every arm) and each
# sweep's logs and PPO runs without checkpoints (metrics.jsonl with the validations, config.yaml,
# run_identity.json), its data cards, the SFT's metrics, config and truncation report, and the world model's
# evaluations (smollm2_sweep.sh's WM_EVAL). Prints each arm's last step and its validation success so far
# (`val-env/<env>/success`), for the runs of every config (job.sh's CONFIG: Sokoban, FrozenLake), each arm named
# <config>/<arm> where there are several. WORK: where job.sh wrote (/tmp).
cd "${WORK:-/tmp}" || exit 1
paths=(out)
[ -e gate.txt ] && paths+=(gate.txt)
for sweep in table2_wm table2_nowm table2_nopred table2_nostate table2_base; do
    for sub in logs ppo wm_eval data/data_card.json data/data_card.md data_nowm/data_card.json sft/metrics.jsonl \
            sft/sft_config.yaml sft/truncation.json; do
        [ -e "$sweep/$sub" ] && paths+=("$sweep/$sub")
    done
done
tar czf "$OUT/table2.tgz" --exclude='global_step_*' --exclude='*.pt' --exclude='*.safetensors' "${paths[@]}"
ls -la "$OUT/table2.tgz"
python - table2_*/ppo/*/*/metrics.jsonl <<'PY'
import json, os, sys
paths = [path for path in sys.argv[1:] if os.path.exists(path)]  # not the pattern itself before the first run
several = len({path.split("/")[2] for path in paths}) > 1  # table2_<start>/ppo/<config>/<arm>/metrics.jsonl
for path in paths:
    records = []
    for line in open(path):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            break
    val = [f"{r['step']}:{r[key]:.3f}" for r in records for key in r
           if key.startswith("val-env/") and key.endswith("/success") and key.count("/") == 2]
    name = "/".join(path.split("/")[2:4]) if several else path.split("/")[3]
    print(name, "step", records[-1]["step"] if records else "-", "val", " ".join(val))
PY

#!/usr/bin/env bash
# The lease's results so far into $OUT/table2.tgz, run at the end of every polling call: job.sh's out/ (progress,
# sweep logs, the pipelining gate's step benchmarks), gate.txt (the overrides the gate gave every arm) and each
# sweep's logs and PPO runs without checkpoints (metrics.jsonl with the validations, config.yaml,
# run_identity.json), its data cards and the SFT's metrics, config and truncation report. Prints each arm's last step
# and its validation success so far. WORK: where job.sh wrote (/tmp).
cd "${WORK:-/tmp}" || exit 1
paths=(out)
[ -e gate.txt ] && paths+=(gate.txt)
for sweep in table2_wm table2_nowm table2_base; do
    for sub in logs ppo data/data_card.json data/data_card.md data_nowm/data_card.json sft/metrics.jsonl \
            sft/sft_config.yaml sft/truncation.json; do
        [ -e "$sweep/$sub" ] && paths+=("$sweep/$sub")
    done
done
tar czf "$OUT/table2.tgz" --exclude='global_step_*' --exclude='*.pt' --exclude='*.safetensors' "${paths[@]}"
ls -la "$OUT/table2.tgz"
python - table2_*/ppo/_2_sokoban/*/metrics.jsonl <<'PY'
import json, sys
for path in sys.argv[1:]:
    records = []
    for line in open(path):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            break
    val = [f"{r['step']}:{r['val-env/SimpleSokoban/success']:.3f}" for r in records
           if "val-env/SimpleSokoban/success" in r]
    print(path.split("/")[-2], "step", records[-1]["step"] if records else "-", "val", " ".join(val))
PY

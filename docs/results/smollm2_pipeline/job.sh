#!/usr/bin/env bash
# Issue 42: pipelined turns (agent_proxy.pipeline_turns) on one GPU. The GPU tests of pipelined turns and of kept
# decode graphs, then the PPO step of SmolLM2-135M-Instruct (benchmarks/smollm2_step.py, base model, 4 steps and a
# validation of 128 x 4) turn by turn and pipelined, in the base prompt mode (issue 42's benchmark) and in
# add_worldmodel (the study's). Set up as docs/results/smollm2_table2/README.md (GGUF in /tmp/smol.gguf, wheels in
# /tmp/site, the tree in /tmp/repo), started with setsid; results in /tmp/out. Run on 2026-11-29 (commit 1971912):
# the tests and the base pair ran; the add_worldmodel pair was stopped to give the lease to the Table 2 job (its
# base model runs to the length cap there too, so it would not have told how an SFT checkpoint does).
export PYTHONPATH="/tmp/site:/tmp/repo" SPA_SMOLLM2_GGUF=/tmp/smol.gguf PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 PATH="/tmp/site/bin:$PATH"
O=/tmp/out; mkdir -p "$O"; cd /tmp/repo || exit 1
p() { echo "$(date -u +%T) $*" >> "$O/progress.txt"; }
nvidia-smi > "$O/gpu.txt" 2>&1
python -m SPA_agent.smollm2 > "$O/convert.log" 2>&1; p "convert rc=$?"
python -m pytest -q -p no:cacheprovider -k gpu tests/generators/test_turn_pipeline.py \
    tests/generators/test_kept_decode_graphs.py > "$O/gpu_tests.log" 2>&1; p "gpu tests rc=$?"
for mode in base add_worldmodel; do
    for pipeline in false true; do
        name="step_${mode}_pipeline_${pipeline}"
        python benchmarks/smollm2_step.py --model-path smollm2-135m --steps 4 --json "$O/$name.json" \
            ctx_manager.mode=$mode agent_proxy.pipeline_turns=$pipeline > "$O/$name.log" 2>&1
        p "$name rc=$?"
    done
done
p done

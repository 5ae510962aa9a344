"""Evaluate a model on the validation puzzles (spec §11). The command line; the evaluation itself is
SPA_agent/evaluation/evaluate.py.

    python -m SPA_agent.evaluate --config-name _2_sokoban model_path=<hf dir | hub id | tiny> \
        [generator=hf|vllm|api] [evaluation.n=8] [evaluation.k=[1,8]] [evaluation.num_puzzles=128]

Writes eval.json, trajectories.jsonl and passk.png under evaluation.output_dir; exits with status 1 when the
evaluation is incomplete (a generation failure: what finished is written, with the reason).
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from SPA_agent.config import CONFIG_DIR
from SPA_agent.entry import apply_system_env, exit_on_interrupt, exit_on_user_error, hydra_entry
from SPA_agent.evaluation.evaluate import evaluate, format_result, prepare_eval_config
from SPA_agent.runs.progress import quiet_library_progress

EXIT_INCOMPLETE = 1


@hydra_entry(CONFIG_DIR)
def main(cfg: DictConfig) -> None:
    quiet_library_progress()
    with exit_on_user_error():
        cfg = prepare_eval_config(cfg)
    with exit_on_user_error(), exit_on_interrupt("nothing was written (an evaluation is saved once complete); "
                                                 "run the same command again"):
        apply_system_env(cfg)
        result = evaluate(cfg)
    print(format_result(result))
    print(f"results written to {cfg.evaluation.output_dir}")
    if not result["complete"]:
        sys.exit(EXIT_INCOMPLETE)


if __name__ == "__main__":
    main()

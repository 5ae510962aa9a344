"""Time one full rollout with the random generator: everything but generation (prompts, tokenization,
parsing, env stepping, masks, scores).

    python benchmarks/rollout_overhead.py [--config _2_sokoban] [--repeats 3] [--model smollm2-135m] [--smoke]

Prints one JSON line per config: median and spread over repeats, in seconds per rollout, at the paper's
batch (32 groups × 8 envs, 5 turns; `--smoke`: 4 × 2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from transformers import AutoTokenizer

from SPA_agent.config import compose
from SPA_agent.generators import build_generator
from SPA_agent.model_presets import resolve_model_path
from SPA_agent.rollout.agent_proxy import LLMAgentProxy


def time_rollouts(config_name: str, repeats: int, smoke: bool, mode: str, model: str = "tiny") -> dict:
    overrides = [f"model={model}", "generator=random", f"ctx_manager.mode={mode}"]
    if not smoke:
        overrides += ["es_manager.train.env_groups=32", "es_manager.train.group_size=8",
                      "es_manager.train.env_configs.n_groups=[32]"]
    cfg = compose(config_name, overrides)
    model_dir = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    proxy = LLMAgentProxy(cfg, build_generator(cfg.generator, model_dir, tokenizer), tokenizer)
    proxy.rollout(val=False)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        rollout = proxy.rollout(val=False)
        times.append(time.perf_counter() - start)
    return {
        "metric": "rollout_overhead", "config": config_name, "mode": mode,
        "envs": len(rollout.states), "seq_len": rollout.batch.batch["input_ids"].shape[1],
        "median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
        "max_s": round(max(times), 3), "unit": "s/rollout",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["_2_sokoban", "_3_frozen_lake", "_10_sudoku"])
    parser.add_argument("--mode", default="add_worldmodel", choices=["base", "add_worldmodel"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="4 groups × 2 envs, one repeat")
    parser.add_argument("--model", default="tiny", help="model preset whose tokenizer renders the prompts "
                                                        "(tiny, small, smollm2-135m)")
    args = parser.parse_args()
    for config_name in args.config:
        print(json.dumps(time_rollouts(config_name, 1 if args.smoke else args.repeats, args.smoke, args.mode, args.model)))


if __name__ == "__main__":
    main()

"""Raw decoding speed of one vLLM engine on batches shaped like a rollout turn (issue 28).

N prompts of random ids (lengths uniform in [0.9, 1.0] × --prompt-len), each sampling exactly --new-tokens
(`ignore_eos`), through offline `vllm.LLM` with the engine settings of the verl backend's rollout
(config/ppo_trainer.yaml: memory share, max_num_seqs, max_num_batched_tokens, prefix caching, CUDA graphs).
What the verl backend's generation phase takes per turn beyond this is its request path (driver, Ray, HTTP
server). Prints one JSON line per timed call: seconds, new tokens per second, milliseconds per decoding step.

    python benchmarks/vllm_decode.py --model DIR [--batches 128 256] [--repeats 3] [--async-scheduling]
        [--model-runner auto|v1|v2] [--engine KEY=VALUE ...] [--profile DIR]

`--model-runner` picks vLLM's model runner as `verl_backend.vllm_model_runner` does for the rollout engines (auto:
vLLM's choice by architecture; V1 for the Qwen2 shapes).

`--engine` overrides one of `vllm.LLM`'s engine arguments (repeatable; VALUE is read as JSON where it parses, else
as a string), e.g. `--engine max_num_batched_tokens=32768` or `--engine 'compilation_config={"cudagraph_mode":
"FULL_DECODE_ONLY"}'`, to try an engine setting against the rollout's. The JSON lines also carry the engine's
sequence and token limits, `async_scheduling` (whether it was forced), the model runner and the overrides.

`--profile DIR` runs vLLM's torch profiler in the engine's worker over PROFILED_STEPS decoding steps of the first
batch size's last call (after PROFILE_DELAY steps, past the prefill) and writes its operator table, costliest GPU time
first, to DIR/profiler_out_0.txt: "Self CUDA time total" over the steps against the call's milliseconds per step
tells whether the GPU or the CPU bounds a decoding step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from SPA_agent.config import compose
from SPA_agent.trainer.verl_backend.config import VLLM_MODEL_RUNNERS, model_runner_env

#: engine steps skipped after the profiler is asked to start (the prefill of 128 prompts of 600 ids in chunks of
#: 8,192 tokens takes about ten), then the decoding steps profiled
PROFILE_DELAY, PROFILED_STEPS = 50, 20


def engine_override(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` → (key, value), the value read as JSON where it parses (numbers, booleans, objects), else kept
    as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face model directory (benchmarks/random_model.py)")
    parser.add_argument("--batches", nargs="+", type=int, default=[128, 256])
    parser.add_argument("--prompt-len", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="force vLLM's async scheduling on (CPU overlaps GPU); without it vLLM decides")
    parser.add_argument("--model-runner", choices=VLLM_MODEL_RUNNERS, default="auto",
                        help="vLLM's model runner, as verl_backend.vllm_model_runner (default: vLLM's choice)")
    parser.add_argument("--engine", type=engine_override, action="append", default=[], metavar="KEY=VALUE",
                        help="an engine argument of vllm.LLM over the rollout's (repeatable)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="profile decoding steps of the first batch size's last call; operator table to DIR")
    args = parser.parse_args()
    os.environ.update(model_runner_env(args.model_runner))  # read by vLLM, and by its engine process it starts

    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rollout = compose("_2_sokoban", [f"model_path={args.model}"]).actor_rollout_ref.rollout
    engine = {"gpu_memory_utilization": rollout.gpu_memory_utilization, "max_model_len": rollout.max_model_len,
              "max_num_seqs": rollout.max_num_seqs, "max_num_batched_tokens": rollout.max_num_batched_tokens,
              "enable_prefix_caching": True, "enforce_eager": False, "dtype": "bfloat16", "seed": 0,
              **({"async_scheduling": True} if args.async_scheduling else {}), **dict(args.engine)}
    if args.profile:
        engine["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": str(args.profile.resolve()),
                                     "torch_profiler_with_stack": False, "ignore_frontend": True,
                                     "delay_iterations": PROFILE_DELAY, "max_iterations": PROFILED_STEPS}
    llm = LLM(model=args.model, **engine)
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.new_tokens, ignore_eos=True,
                              detokenize=False)
    rng = random.Random(0)
    for batch in args.batches:
        for repeat in range(args.repeats + 1):  # the first call warms up
            prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(
                rng.randint(int(0.9 * args.prompt_len), args.prompt_len))]) for _ in range(batch)]
            profiled = args.profile is not None and batch == args.batches[0] and repeat == args.repeats
            if profiled:
                llm.start_profile()
            start = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            seconds = time.perf_counter() - start
            if profiled:
                llm.stop_profile()
            new = sum(len(o.outputs[0].token_ids) for o in outputs)
            record = {"batch": batch, "repeat": repeat, "seconds": round(seconds, 3),
                      "new_tokens_per_s": round(new / seconds),
                      "ms_per_step": round(1000 * seconds / args.new_tokens, 2),
                      "async_scheduling": args.async_scheduling, "model_runner": args.model_runner,
                      "max_num_seqs": engine["max_num_seqs"],
                      "max_num_batched_tokens": engine["max_num_batched_tokens"], "engine_overrides": dict(args.engine),
                      "profiled_steps": PROFILED_STEPS if profiled else 0}
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

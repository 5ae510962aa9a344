"""Generation speed of the hf generator: transformers' `generate` vs our static-cache decoder (issue 9).

Models are Qwen2 configurations of the Qwen2.5-0.5B / 1.5B shapes with random weights, built here (no
download). Prompts are random token ids whose lengths vary in [0.9, 1.0] × --prompt-len (left padding, as in
rollouts); sampling is the data-generation setting (temperature 1, top_p 1, top_k off). Every timed call goes
through `HFGenerator.generate` (padding, decoding to text included). Prints one JSON line per measurement.

    python benchmarks/generation.py                     # GPU: 0.5B and 1.5B, batch 64 and 256
    python benchmarks/generation.py --smoke             # CI size: tiny shape on CPU, seconds
    python benchmarks/generation.py --rollout           # also one full data-generation rollout (32×8 envs × 5
    turns)

Each static-decoder call captures its CUDA graph (freed between calls); `capture_s` reports that part of the
call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from model_shapes import SHAPES

from SPA_agent.generators.base import Prompt, SamplingParams
from SPA_agent.generators.hf import HFGenerator

EOS_IDS, PAD_ID = [1, 2], 0  # ids our random prompts never contain


class IdTokenizer:
    """Enough of a tokenizer for the generator: decoding writes the ids (the model has no vocabulary)."""

    eos_token_id, pad_token_id = EOS_IDS[0], PAD_ID

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def build_model(shape: str, device: torch.device, vocab_size: int | None = None):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **{**SHAPES[shape], **({"vocab_size": vocab_size} if vocab_size else {})},
        max_position_embeddings=32768,
        attn_implementation="sdpa",
        eos_token_id=EOS_IDS[0],
        pad_token_id=PAD_ID,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.generation_config = GenerationConfig(eos_token_id=EOS_IDS, pad_token_id=PAD_ID)
    return model


def random_prompts(
    batch: int, prompt_len: int, vocab_size: int, seed: int, uniform: bool = False
) -> list[Prompt]:
    """Random ids; lengths uniform in [0.9, 1] × prompt_len, or all prompt_len (no padding) when `uniform`."""
    generator = torch.Generator().manual_seed(seed)
    low = prompt_len if uniform else int(0.9 * prompt_len)
    lengths = torch.randint(low, prompt_len + 1, (batch,), generator=generator)
    return [
        Prompt(messages=[], prompt_ids=torch.randint(3, vocab_size, (int(n),), generator=generator).tolist())
        for n in lengths
    ]


def timed_call(generator: HFGenerator, prompts: list[Prompt]) -> tuple[float, int]:
    """(seconds, new tokens) of one generate call."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    generations = generator.generate(prompts)
    return time.perf_counter() - start, sum(len(g.token_ids) for g in generations)


def hf_generator(
    model, decoder: str, batch_size: int, new_tokens: int, temperature: float = 1.0
) -> HFGenerator:
    sampling = SamplingParams(temperature=temperature, top_p=1.0, top_k=-1, max_new_tokens=new_tokens)
    return HFGenerator(model, IdTokenizer(), sampling, batch_size=batch_size, decoder=decoder, progress=False)


def measure(model, decoder: str, prompts: list[Prompt], new_tokens: int, repeats: int) -> dict:
    """A short warm-up call, then `repeats` timed calls. Each static-decoder call captures its CUDA graph
    again (the buffers are freed between calls); `capture_s` is that part of the timed call."""
    timed_call(hf_generator(model, decoder, len(prompts), 8), prompts)
    generator = hf_generator(model, decoder, len(prompts), new_tokens)
    runs, captures = [], []
    for _ in range(repeats):
        runs.append(timed_call(generator, prompts))
        captures.append(generator._static.last_capture_s if generator._static is not None else 0.0)
    rates = [tokens / seconds for seconds, tokens in runs]
    return {
        "decoder": decoder,
        "new_tokens_per_s": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "seconds": statistics.median(s for s, _ in runs),
        "new_tokens": runs[0][1],
        "capture_s": statistics.median(captures),
        "repeats": repeats,
    }


def teacher_forced_check(model, prompts: list[Prompt], outputs: list[list[int]]) -> dict:
    """Re-score prompt + greedy output in one full forward (transformers' own attention, no cache): the
    fraction of generated tokens that are the argmax there, and the largest logit gap where they are not
    (near-ties that rounding can flip have gaps near the dtype's resolution)."""
    from SPA_agent.generators.hf import left_pad

    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad([p.prompt_ids + o for p, o in zip(prompts, outputs)], PAD_ID, device)
    longest = max(len(o) for o in outputs)
    with torch.inference_mode():
        logits = (
            model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0),
                logits_to_keep=longest + 1,
                past_key_values=None,
                use_cache=False,
            )
            .logits[:, :-1]
            .float()
        )
    agree, total, worst_gap = 0, 0, 0.0
    for row, output in enumerate(outputs):
        scores = logits[row, longest - len(output) :]
        chosen = torch.tensor(output, device=device)
        gaps = scores.max(dim=-1).values - scores.gather(1, chosen[:, None]).squeeze(1)
        agree += int((gaps == 0).sum())
        total += len(output)
        worst_gap = max(worst_gap, float(gaps.max()))
    return {"teacher_forced_agreement": agree / total, "max_gap_where_not_argmax": worst_gap}


def check_greedy(model, prompts: list[Prompt], new_tokens: int) -> list[dict]:
    """Greedy tokens of both decoders, in the model's dtype and in float32: identical sequences between the
    decoders, and each decoder's agreement with a teacher-forced re-scoring. Random weights give near-uniform
    logits, so in bf16 near-ties flip often for either decoder; float32 separates numerics from bugs."""
    results, original = [], next(model.parameters()).dtype
    for dtype in (original, torch.float32):
        model = model.to(dtype)
        outputs = {
            d: [g.token_ids for g in hf_generator(model, d, len(prompts), new_tokens, 0.0).generate(prompts)]
            for d in ("generate", "static")
        }
        results.append(
            {
                "dtype": str(dtype).replace("torch.", ""),
                "sequences_identical": sum(x == y for x, y in zip(*outputs.values())) / len(prompts),
                **{d: teacher_forced_check(model, prompts, o) for d, o in outputs.items()},
            }
        )
    model.to(original)
    return results


def run_generation(args, device: torch.device) -> None:
    for shape in args.shapes:
        model = build_model(shape, device)
        if args.check:
            prompts = random_prompts(args.check_batch, args.prompt_len, model.config.vocab_size, seed=1)
            for result in check_greedy(model, prompts, args.check_tokens):
                print(
                    json.dumps(
                        {
                            "metric": "greedy_check",
                            "shape": shape,
                            "batch": args.check_batch,
                            "new_tokens": args.check_tokens,
                            **result,
                        }
                    ),
                    flush=True,
                )
        for batch in args.batches:
            prompts = random_prompts(
                batch, args.prompt_len, model.config.vocab_size, seed=batch, uniform=args.uniform
            )
            results = {
                d: measure(
                    model,
                    d,
                    prompts,
                    args.new_tokens,
                    args.baseline_repeats if d == "generate" else args.repeats,
                )
                for d in args.decoders
            }
            for result in results.values():
                print(
                    json.dumps(
                        {
                            "metric": "generation",
                            "shape": shape,
                            "batch": batch,
                            "prompt_len": args.prompt_len,
                            "uniform_prompts": args.uniform,
                            "device": device_name(device),
                            **result,
                        }
                    ),
                    flush=True,
                )
            if {"generate", "static"} <= set(results):
                ratio = results["static"]["new_tokens_per_s"] / results["generate"]["new_tokens_per_s"]
                print(
                    json.dumps(
                        {
                            "metric": "speedup_static_over_generate",
                            "shape": shape,
                            "batch": batch,
                            "uniform_prompts": args.uniform,
                            "value": round(ratio, 2),
                        }
                    ),
                    flush=True,
                )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_rollout(args, device: torch.device) -> None:
    """One data-generation rollout (add_worldmodel prompts, 32 groups × 8 envs, up to 5 turns) with a random
    model of the chosen shape over the tiny tokenizer's vocabulary (no download)."""
    from transformers import AutoTokenizer

    from SPA_agent.config import compose
    from SPA_agent.rollout.agent_proxy import LLMAgentProxy
    from SPA_agent.tiny import tiny_model_dir

    shape = args.shapes[-1]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    overrides = ["model=tiny"] if args.smoke else []
    cfg = compose("_2_sokoban", [*overrides, "ctx_manager.mode=add_worldmodel"])
    model = build_model(shape, device, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    for decoder in args.decoders:
        sampling = SamplingParams.from_config(cfg.generator)
        generator = HFGenerator(
            model,
            tokenizer,
            sampling,
            batch_size=cfg.generator.batch_size,
            max_batch_tokens=cfg.generator.max_batch_tokens,
            decoder=decoder,
            progress=False,
        )
        proxy = LLMAgentProxy(cfg, generator, tokenizer)  # ctx_manager.mode=add_worldmodel
        start = time.perf_counter()
        rollout = proxy.rollout(val=False)
        seconds = time.perf_counter() - start
        es = cfg.es_manager.train
        print(
            json.dumps(
                {
                    "metric": "rollout_seconds",
                    "shape": shape,
                    "decoder": decoder,
                    "value": seconds,
                    "envs": es.env_groups * es.group_size,
                    "max_turn": cfg.agent_proxy.max_turn,
                    "response_length": sampling.max_new_tokens,
                    "batch_size": generator.batch_size,
                    "trajectories": len(rollout.states),
                    "device": device_name(device),
                }
            ),
            flush=True,
        )


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of the static decoder")
    parser.add_argument(
        "--baseline-repeats", type=int, default=1, help="timed calls of transformers' generate"
    )
    parser.add_argument("--check", action="store_true", help="first compare greedy tokens of both decoders")
    parser.add_argument("--check-batch", type=int, default=16)
    parser.add_argument("--check-tokens", type=int, default=64)
    parser.add_argument(
        "--uniform", action="store_true", help="all prompts exactly --prompt-len (no padding)"
    )
    parser.add_argument(
        "--decoders", nargs="+", default=["generate", "static"], choices=["generate", "static"]
    )
    parser.add_argument("--rollout", action="store_true", help="also time one full data-generation rollout")
    parser.add_argument("--no-generation", action="store_true", help="skip the plain generation measurements")
    parser.add_argument("--smoke", action="store_true", help="CI size: tiny shape on CPU")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.batches, args.prompt_len, args.new_tokens, args.repeats = ["tiny"], [4], 32, 8, 1
        args.check, args.check_batch, args.check_tokens = True, 4, 16
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if not args.no_generation:
        run_generation(args, device)
    if args.rollout:
        run_rollout(args, device)


if __name__ == "__main__":
    main()

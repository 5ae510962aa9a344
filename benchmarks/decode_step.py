"""Where one step of the static decoder spends its time (issue 17): the whole CUDA-graph step, sampling, and the
decode attention alone, at the PPO rollout's batch and several context lengths.

A random-weight model of the --shape (Qwen2.5-0.5B by default) is built on the GPU; for each --contexts C the
decoder's buffers are filled by a prefill of B prompts of C random ids and then --steps decode steps are timed
with CUDA events:

- `step`: one replay of the captured decode step (forward of one token per row, logits of the last position);
- `sample`: softmax + multinomial over the float32 logits (temperature 1, no top-k/top-p: the PPO settings);
- `attention/<backend>`: the grouped decode attention of one layer (queries (B, H_kv, G, D) against the cache
  (B, H_kv, L, D) with the boolean key mask) through SDPA's memory-efficient and math backends and a plain
  matmul-softmax-matmul, times the number of layers (so it compares with `step`).

--profile adds a torch.profiler table (eager steps, no CUDA graph) of the kernels by GPU time. --variants also
times the step of the model patched by liger-kernel (RMSNorm, SwiGLU, RoPE) and of a torch.compile'd forward.

    python benchmarks/decode_step.py --shape 0.5b --batch 256 --contexts 700 1500 2300 --profile
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from model_shapes import SHAPES
from torch.nn.attention import SDPBackend, sdpa_kernel

from SPA_agent.generators.base import SamplingParams
from SPA_agent.generators.static_decode import PROMPT_BUCKET, StaticDecoder, grouped_attention, sample


def build_model(shape: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768)
    return Qwen2ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()


def cuda_ms(fn, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` calls, each timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def filled_state(decoder: StaticDecoder, batch: int, context: int, steps: int, vocab: int):
    """Decoder state after a prefill of `batch` prompts of `context` random ids, ready for decode steps."""
    max_len = context + steps
    max_len += -max_len % PROMPT_BUCKET
    state = decoder._state_for(batch, max_len)
    ids = torch.randint(3, vocab, (batch, context), device="cuda")
    mask = torch.ones_like(ids)
    state.capture()
    logits = decoder._prefill(state, ids, mask)
    state.input_ids.copy_(ids[:, -1:])
    state.position_ids.fill_(context)
    state.write_index.fill_(context)
    return state, logits


def time_step(model, args, context: int) -> float:
    decoder = StaticDecoder(model, stop_ids=[1], pad_id=0)
    with torch.inference_mode(), grouped_attention(model):
        state, _ = filled_state(decoder, args.batch, context, args.steps, model.config.vocab_size)
        for _ in range(3):
            state.step()
        return cuda_ms(state.step, args.steps)


def attention_times(config, args, context: int) -> dict[str, float]:
    """Milliseconds of one layer's grouped decode attention × layers, per implementation."""
    kv_heads, heads = config.num_key_value_heads, config.num_attention_heads
    head_dim = config.hidden_size // heads
    length = context + args.steps + (-(context + args.steps) % PROMPT_BUCKET)
    q = torch.randn(args.batch, kv_heads, heads // kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(args.batch, kv_heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    keys = torch.zeros(args.batch, 1, 1, length, dtype=torch.bool, device="cuda")
    keys[..., : context + 1] = True
    bias = torch.zeros(keys.shape, device="cuda").masked_fill(~keys, float("-inf"))
    scale = head_dim**-0.5

    def plain():
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
        return torch.matmul(scores.softmax(-1).to(v.dtype), v)

    reference = plain()
    times = {}
    for name, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keys, scale=scale)
        error = (run().float() - reference.float()).abs().max().item()
        times[name] = cuda_ms(run, args.steps) * config.num_hidden_layers
        times[f"{name}_max_error"] = error
    times["plain"] = cuda_ms(plain, args.steps) * config.num_hidden_layers
    return times


def time_sampling(logits: torch.Tensor, args) -> float:
    params = SamplingParams(temperature=1.0, max_new_tokens=args.steps)
    generator = torch.Generator("cuda").manual_seed(0)
    return cuda_ms(lambda: sample(logits, params, generator), args.steps)


def profile_table(model, args, context: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    decoder = StaticDecoder(model, stop_ids=[1], pad_id=0, use_cuda_graphs=False)
    with torch.inference_mode(), grouped_attention(model):
        state, _ = filled_state(decoder, args.batch, context, args.steps, model.config.vocab_size)
        state.forward_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                state.forward_step()
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[700, 1500, 2300])
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per measurement")
    parser.add_argument("--profile", action="store_true", help="print a kernel table at the longest context")
    parser.add_argument("--variants", nargs="*", default=[], choices=("liger", "compile"),
                        help="also time the step of these model variants")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_step.py needs a CUDA GPU")
    from SPA_agent.trainer.packing import avoid_cudnn_attention

    avoid_cudnn_attention()  # as the local backend runs
    model = build_model(args.shape)
    for context in args.contexts:
        row = {"shape": args.shape, "batch": args.batch, "context": context,
               "step_ms": round(time_step(model, args, context), 3)}
        decoder = StaticDecoder(model, stop_ids=[1], pad_id=0)
        with torch.inference_mode(), grouped_attention(model):
            _, logits = filled_state(decoder, args.batch, context, args.steps, model.config.vocab_size)
            row["sample_ms"] = round(time_sampling(logits, args), 3)
        decoder.release()
        with torch.inference_mode():
            row.update({f"attention_ms/{k}": round(v, 4) for k, v in attention_times(model.config, args,
                                                                                  context).items()})
        print(json.dumps(row), flush=True)
    if args.profile:
        print(profile_table(model, args, max(args.contexts)), flush=True)
    for variant in args.variants:
        if variant == "liger":
            from liger_kernel.transformers import apply_liger_kernel_to_qwen2

            apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False, model=model)
        else:
            model.forward = torch.compile(model.forward, dynamic=False)
        for context in args.contexts:
            print(json.dumps({"variant": variant, "context": context,
                              "step_ms": round(time_step(model, args, context), 3)}), flush=True)


if __name__ == "__main__":
    main()

"""Where the static decoder spends its time (issue 17): prefill, the whole CUDA-graph decode step, sampling,
and the decode attention alone, at the PPO rollout's batch and several context lengths.

A random-weight model of the --shape (Qwen2.5-0.5B by default) is built on the GPU; for each --contexts C the
decoder's cache is filled by a prefill of B prompts of C random ids, then timed with CUDA events:

- `prefill`: that prefill (right-padded rows, causal, chunks of PREFILL_TOKENS tokens, first-token logits);
- `step`: one replay of the captured decode step (forward of one token per row, logits of the last position);
- `sample`: softmax + multinomial over the float32 logits (temperature 1, no top-k/top-p: the PPO settings);
- `attention/<path>`: one layer's decode attention (queries (B, H, 1, D) against the cache (B, L, H_kv, D), each
  row reading its first C+1 keys, a finished row one) through flash attention's variable-length kernel (`flash`),
  the Triton split-KV kernel (`split_kv`, split_kv_decode.py), the split-KV kernel that reads a prefix shared by a
  group of rows once (`split_kv_shared`, shared_prefix_decode.py) and one masked SDPA call (`masked`, the path on
  CPU), times the number of layers (so it compares with `step`); `max_gap/<path>`: its largest difference from
  `masked`.

--shared-prefix P (default 556, SPA's first prompt on SmolLM2): the rows come in groups of 8, as a PPO batch's samples
of a puzzle, whose prompts (and, for `attention/*`, keys and values) share their first min(P, C) positions; only
`split_kv_shared` reads them once a group (the others cost the same for any ids).

--attention names the decode attention kernels whose whole step is timed (`step_ms/<kernel>`; default: all).
--split-kv-tiles SPLITxBLOCK_NxWARPS ... times the split-KV step and its attention alone with other tile sizes
(split_kv_decode.SPLIT, BLOCK_N, NUM_WARPS), after the Liger patch when --liger is given.

--profile adds a torch.profiler table (eager steps, no CUDA graph) of the kernels by GPU time. --liger also times
prefill and step (and profiles) of the model as `generator.liger_kernels=true` runs it (liger_decode.py: Liger's
RMSNorm, SwiGLU and RoPE). --finished F marks that share of the rows finished (they read one key, as rows that
emitted their end of turn do). `--shape smollm2-135m` is SmolLM2-135M's Llama shape.

    python benchmarks/decode_step.py --shape 0.5b --batch 256 --contexts 700 1500 2300 --profile
    python benchmarks/decode_step.py --shape smollm2-135m --contexts 400 900 1300 --finished 0.6 --liger --profile
    python benchmarks/decode_step.py --shape smollm2-135m --contexts 400 900 1300 --finished 0.6 --liger \
        --attention flash split_kv
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch
from generation import build_model
from model_shapes import SHAPES

from SPA_agent.generators import liger_decode, split_kv_decode
from SPA_agent.generators.base import SamplingParams
from SPA_agent.generators.shared_prefix_decode import PrefixTables, shared_prefix_decode
from SPA_agent.generators.static_decode import (
    ATTENTION_KERNELS,
    PROMPT_BUCKET,
    StaticDecoder,
    decode_attention_mode,
    flash_decode,
    masked_decode,
    sample,
)


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


#: SmolLM2-135M-Instruct's LlamaConfig keyword arguments (docs/smollm2.md)
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0,
                 "rms_norm_eps": 1e-5}


def decode_model(shape: str):
    """A random-weight bf16 model of the shape on the GPU: the Qwen2 shapes of model_shapes.py, or SmolLM2's."""
    if shape != "smollm2-135m":
        return build_model(shape, torch.device("cuda"))
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        config = LlamaConfig(**SMOLLM2_SHAPE, attn_implementation="sdpa", eos_token_id=1, pad_token_id=0)
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


#: rows a group of samples of one prompt (--shared-prefix): SPA's group size
GROUP = 8


def filled_state(decoder: StaticDecoder, batch: int, context: int, steps: int, vocab: int, finished: float = 0.0,
                 shared: int = 0):
    """Decoder state after a prefill of `batch` prompts of `context` random ids, each group of GROUP rows sharing its
    first `shared`, ready for decode steps (split_kv_shared's tables filled); the prefill's milliseconds and the first
    logits."""
    max_len = context + steps
    max_len += -max_len % PROMPT_BUCKET
    state = decoder._state_for(batch, max_len)
    prompts = torch.randint(3, vocab, (batch, context), device="cuda")
    leaders = torch.arange(batch, device="cuda") // GROUP * GROUP
    prompts[:, :shared] = prompts[leaders, :shared]
    if state.prefixes is not None:
        state.share_prefixes(prompts.tolist())
    lengths = torch.full((batch,), context, device="cuda")
    state.capture()
    logits = decoder._prefill(state, prompts, lengths)
    prefill_ms = cuda_ms(lambda: decoder._prefill(state, prompts, lengths), 3)
    state.input_ids.copy_(prompts[:, -1:])
    state.positions.fill_(context)
    state.finished[: finished_rows(batch, finished)] = True
    return state, prefill_ms, logits


def finished_rows(batch: int, finished: float) -> int:
    return int(finished * batch)


def kernels(model, liger: bool):
    """The context a decode runs in: Liger's rotary function while it runs for a patched model (liger_decode)."""
    return liger_decode.fused_rope(model) if liger else contextlib.nullcontext()


def time_step(model, args, context: int, liger: bool = False, attention: str = "flash") -> tuple[float, float]:
    """(prefill ms, decode step ms) at this context."""
    decoder = StaticDecoder(model, stop_ids=[1], pad_id=0, attention=attention)
    with torch.inference_mode(), decode_attention_mode(model), kernels(model, liger):
        state, prefill_ms, _ = filled_state(decoder, args.batch, context, args.steps, model.config.vocab_size,
                                            args.finished, min(args.shared_prefix, context))
        for _ in range(3):
            state.step()
        return prefill_ms, cuda_ms(state.step, args.steps)


def attention_times(config, args, context: int) -> dict[str, float]:
    """Milliseconds of one layer's decode attention × layers, per path, and the largest gap between them."""
    kv_heads, heads = config.num_key_value_heads, config.num_attention_heads
    head_dim = config.hidden_size // heads
    length = context + args.steps + (-(context + args.steps) % PROMPT_BUCKET)
    batch, to = args.batch, dict(device="cuda", dtype=torch.bfloat16)
    query = torch.randn(batch, heads, 1, head_dim, **to)
    key, value = (torch.randn(batch, length, kv_heads, head_dim, **to) for _ in range(2))
    kv_lengths = torch.full((batch,), context + 1, device="cuda", dtype=torch.int32)
    kv_lengths[: finished_rows(batch, args.finished)] = 1
    shared = min(args.shared_prefix, context)
    leaders = torch.arange(batch, device="cuda") // GROUP * GROUP
    key[:, :shared], value[:, :shared] = key[leaders, :shared], value[leaders, :shared]
    rows = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    scale = head_dim**-0.5
    cu_q = rows * (heads // kv_heads)  # the grouped queries: G a row
    flash = lambda: flash_decode(query, key, value, kv_lengths, cu_q, rows * length, scale)  # noqa: E731
    masked = lambda: masked_decode(query, key, value, kv_lengths, scale)  # noqa: E731
    paths = {"flash": flash, "masked": masked}
    if split_kv_decode.available():
        paths["split_kv"] = lambda: split_kv_decode.split_kv_decode(query, key, value, kv_lengths, scale)
        tables = PrefixTables(batch, torch.device("cuda"))
        tables.fill([shared] * batch, [list(range(start, min(start + GROUP, batch))) for start in range(0, batch, GROUP)])
        paths["split_kv_shared"] = lambda: shared_prefix_decode(query, key, value, kv_lengths, tables.tensors, scale)
    reference = masked().float()
    times = {name: cuda_ms(fn, args.steps) * config.num_hidden_layers for name, fn in paths.items()}
    gaps = {f"max_gap/{name}": (fn().float() - reference).abs().max().item() for name, fn in paths.items()
            if name != "masked"}
    return {**times, **gaps}


def time_sampling(logits: torch.Tensor, args) -> float:
    params = SamplingParams(temperature=1.0, max_new_tokens=args.steps)
    generator = torch.Generator("cuda").manual_seed(0)
    return cuda_ms(lambda: sample(logits, params, generator), args.steps)


def profile_table(model, args, context: int, liger: bool = False) -> str:
    from torch.profiler import ProfilerActivity, profile

    decoder = StaticDecoder(model, stop_ids=[1], pad_id=0, use_cuda_graphs=False, attention=args.attention[-1])
    with torch.inference_mode(), decode_attention_mode(model), kernels(model, liger):
        state, _, _ = filled_state(decoder, args.batch, context, args.steps, model.config.vocab_size, args.finished,
                                   min(args.shared_prefix, context))
        state.forward_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                state.forward_step()
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted([*SHAPES, "smollm2-135m"]), default="0.5b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[700, 1500, 2300])
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per measurement")
    parser.add_argument("--profile", action="store_true", help="print a kernel table at the longest context")
    parser.add_argument("--liger", action="store_true", help="also time the model patched by liger-kernel")
    parser.add_argument("--finished", type=float, default=0.0, help="share of rows that have finished (0-1)")
    parser.add_argument("--attention", nargs="+", choices=ATTENTION_KERNELS, default=list(ATTENTION_KERNELS),
                        help="decode attention kernels to time the step with (the profile uses the last)")
    parser.add_argument("--shared-prefix", type=int, default=556,
                        help=f"positions the prompts of each group of {GROUP} rows share (split_kv_shared reads them once)")
    parser.add_argument("--split-kv-tiles", nargs="+", default=[], metavar="SPLITxBLOCK_NxWARPS",
                        help="split-KV tile sizes to time, e.g. 256x64x4 128x64x4 512x128x8")
    args = parser.parse_args()
    tile_sizes = [parse_tiles(text) for text in args.split_kv_tiles]
    if not torch.cuda.is_available():
        raise SystemExit("decode_step.py needs a CUDA GPU")
    from SPA_agent.trainer.packing import avoid_cudnn_attention

    avoid_cudnn_attention()  # as the local backend runs
    model = decode_model(args.shape)
    for context in args.contexts:
        row = {"shape": args.shape, "batch": args.batch, "context": context, "finished": args.finished}
        for attention in args.attention:
            prefill_ms, step_ms = time_step(model, args, context, attention=attention)
            row.update({"prefill_ms": round(prefill_ms, 2), f"step_ms/{attention}": round(step_ms, 3)})
        decoder = StaticDecoder(model, stop_ids=[1], pad_id=0)
        with torch.inference_mode(), decode_attention_mode(model):
            _, _, logits = filled_state(decoder, args.batch, context, args.steps, model.config.vocab_size)
            row["sample_ms"] = round(time_sampling(logits, args), 3)
        decoder.release()
        with torch.inference_mode():
            times = attention_times(model.config, args, context)
        row.update({f"attention_ms/{k}": round(v, 4) for k, v in times.items()})
        print(json.dumps(row), flush=True)
    if args.profile:
        print(profile_table(model, args, max(args.contexts)), flush=True)
    if args.liger:
        liger_decode.check_liger(model)
        liger_decode.patch_model(model)
        for context in args.contexts:
            row = {"variant": "liger", "context": context}
            for attention in args.attention:
                prefill_ms, step_ms = time_step(model, args, context, liger=True, attention=attention)
                row.update({"prefill_ms": round(prefill_ms, 2), f"step_ms/{attention}": round(step_ms, 3)})
            print(json.dumps(row), flush=True)
        if args.profile:
            print(profile_table(model, args, max(args.contexts), liger=True), flush=True)
    for tiles in tile_sizes:
        time_tiles(model, args, tiles)


def parse_tiles(text: str) -> tuple[int, int, int]:
    """`SPLITxBLOCK_NxWARPS` → (split, block_n, warps); BLOCK_N and WARPS powers of two, as Triton needs."""
    try:
        split, block_n, warps = (int(part) for part in text.split("x"))
    except ValueError:
        raise SystemExit(f"--split-kv-tiles takes SPLITxBLOCK_NxWARPS, e.g. 256x64x4; got {text!r}") from None
    if split < 1 or block_n < 16 or block_n & (block_n - 1) or warps < 1 or warps & (warps - 1):
        raise SystemExit(f"--split-kv-tiles {text}: SPLIT ≥ 1, BLOCK_N a power of two ≥ 16, WARPS a power of two")
    return split, block_n, warps


def time_tiles(model, args, tiles: tuple[int, int, int]) -> None:
    """The split-KV step and attention at each context with these tile sizes."""
    split_kv_decode.SPLIT, split_kv_decode.BLOCK_N, split_kv_decode.NUM_WARPS = tiles
    for context in args.contexts:
        _, step_ms = time_step(model, args, context, liger=args.liger, attention="split_kv")
        with torch.inference_mode():
            attention_ms = attention_times(model.config, args, context)["split_kv"]
        print(json.dumps({"tiles": "x".join(map(str, tiles)), "liger": args.liger, "context": context, "step_ms": round(step_ms, 3),
                          "attention_ms": round(attention_ms, 4)}), flush=True)


if __name__ == "__main__":
    main()

"""SFT throughput: our packed batching vs the original recipe's (micro batch 1, every row padded to 2048).

Runs the trainer's own pieces (FSDP2 `shard` with bf16 mixed precision, `plan_packed`/`plan_padded`,
`collate_*`, `token_loss_sum`, AdamW, clipping) on one device, on a Qwen2.5-1.5B-shaped model with random
weights (no download) and synthetic SPA-shaped rows: prompts U(400, 1800) tokens, responses U(60, 250) + eos.
Prints one JSON line per variant: useful (non-padding) tokens/s (median over timed steps) and MFU.

    python benchmarks/sft_throughput.py                 # GPU: original vs packed (sdpa, flex_attention)
    python benchmarks/sft_throughput.py --smoke         # tiny model on CPU, a few steps
    python benchmarks/sft_throughput.py --variants packed-flex --budgets 16384 --multiple 512 --liger both
                                                        # GPU: plain, then Liger kernels (model.use_liger=true)

MFU = useful tokens/s × FLOPs per useful token / peak. FLOPs per token: 6 × (non-embedding parameters +
hidden × vocab for the output projection) plus causal attention 6 × layers × hidden × (row length) averaged
per token; peak = 989 TFLOP/s (H100/H200 SXM dense bf16). This counts the output projection at every token,
but the loss projects only the trained positions (the response, ~13% of these rows' tokens), so `mfu_trained_logits`
also reports MFU with the projection counted where it is computed (6 × hidden × vocab per trained token).

`--liger both` measures every variant with the plain modules first, then with Liger's kernels (Liger swaps RoPE
process-wide, so plain runs must come first). `first_step_s` is the first (untimed) step, flex attention's compile
included: it uses the persistent compile cache (SPA_agent/runs/compile_cache.py) like the trainer, so a second run of
the script on the same machine shows the warm-cache figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from model_shapes import SHAPES
from torch.distributed.device_mesh import init_device_mesh

from sft.fsdp_model import shard
from sft.liger import CHUNK_MEM_CONST, apply_liger, check_liger, fused_token_loss_sum
from sft.packing import (
    collate_packed,
    collate_padded,
    count_loss_tokens,
    plan_packed,
    plan_padded,
    token_loss_sum,
)
from sft.spa_sft_dataset import SftSample
from SPA_agent.runs.compile_cache import use_persistent_compile_cache

PEAK_FLOPS = 989e12


def synthetic_rows(n: int, vocab: int, max_length: int, scale: float, seed: int = 0) -> list[SftSample]:
    """Rows shaped like stage-1 data: prompt U(400,1800)·scale, response U(60,250)·scale (+eos) trained."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        p = int(torch.randint(int(400 * scale), int(1800 * scale) + 1, (1,), generator=g))
        r = int(torch.randint(int(60 * scale), int(250 * scale) + 1, (1,), generator=g)) + 1
        ids = torch.randint(0, vocab, (min(p + r, max_length),), generator=g)
        mask = torch.zeros_like(ids)
        mask[-r:] = 1
        rows.append(SftSample(ids, mask))
    return rows


def flops_per_step(rows: list[SftSample], cfg, trained_logits_only: bool = False) -> float:
    """Model FLOPs of one step (forward + backward); `trained_logits_only`: the output projection counted only at
    trained positions (labels of shifted_labels), as the loss computes it."""
    d, layers, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    head = d // cfg.num_attention_heads
    attn = d * head * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + d * d
    per_layer = attn + 3 * d * cfg.intermediate_size
    body, projection = 6 * layers * per_layer, 6 * d * v
    total = 0.0
    for r in rows:
        projected = int(r.loss_mask[1:].sum()) if trained_logits_only else len(r)
        total += len(r) * body + projected * projection + 6 * layers * d * len(r) ** 2  # causal attn: 2·s²·d fwd
    return total


def build(cfg, attn: str, device: torch.device, liger: bool) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(cfg)
    model.config.use_cache = False
    if liger:
        apply_liger(model)
    mesh = init_device_mesh(device.type, (1,))
    return shard(model, mesh, bf16=device.type == "cuda")


def step(model, optimizer, rows, plan, pad_to, packed_pad, device, loss_sum) -> None:
    """One optimizer step exactly as SftTrainer.train_step does it (one rank)."""
    if packed_pad is None:
        batches = [collate_padded([rows[i] for i in m], 0, pad_to) for m in plan[0]]
    else:
        batches = [collate_packed([rows[i] for i in m], 0, packed_pad) for m in plan[0]]
    n_loss = sum(count_loss_tokens(b) for b in batches)
    for batch in batches:
        loss = loss_sum(model, {k: v.to(device, non_blocking=True) for k, v in batch.items()})
        (loss / n_loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(name, cfg, attn, rows, make_plan, pad_to, packed_pad, args, device, liger: bool) -> dict:
    model = build(cfg, attn, device, liger)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.01)
    loss_sum = (lambda m, b: fused_token_loss_sum(m, b, args.liger_chunk_mem_const)) if liger else token_loss_sum
    times, tokens, flops, trained_flops, first_step = [], [], [], [], None
    for k in range(args.warmup + args.steps):
        batch_rows = rows[(k * args.batch) % len(rows):][:args.batch]
        plan = make_plan(list(range(len(batch_rows))), [len(r) for r in batch_rows])
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, optimizer, batch_rows, plan, pad_to, packed_pad, device, loss_sum)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if k == 0:
            first_step = time.perf_counter() - start
        if k >= args.warmup:
            times.append(time.perf_counter() - start)
            tokens.append(sum(len(r) for r in batch_rows))
            flops.append(flops_per_step(batch_rows, cfg))
            trained_flops.append(flops_per_step(batch_rows, cfg, trained_logits_only=True))
    rates = [t / s for t, s in zip(tokens, times)]
    mfu = [f / s / PEAK_FLOPS for f, s in zip(flops, times)]
    mfu_trained = [f / s / PEAK_FLOPS for f, s in zip(trained_flops, times)]
    result = {"metric": "sft_useful_tokens_per_s", "variant": name, "attn": attn, "liger": liger,
              "median": statistics.median(rates), "min": min(rates), "max": max(rates), "unit": "tokens/s",
              "mfu": statistics.median(mfu), "mfu_trained_logits": statistics.median(mfu_trained),
              "step_s": statistics.median(times), "steps": args.steps, "first_step_s": first_step,
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    print(json.dumps(result), flush=True)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, 2 timed steps")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="rows per optimizer step (paper: 16)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8192, 16384], help="packed token budgets")
    parser.add_argument("--multiple", type=int, default=2048, help="flex: pad packed rows to a multiple")
    parser.add_argument("--variants", nargs="+", default=["original", "packed-sdpa", "packed-flex"])
    parser.add_argument("--liger", choices=["off", "on", "both"], default="off",
                        help="Liger kernels (model.use_liger): off, on, or both (plain first); GPU only")
    parser.add_argument("--liger-chunk-mem-const", type=int, default=CHUNK_MEM_CONST,
                        help="Liger fused cross-entropy chunking (larger = fewer, bigger chunks)")
    args = parser.parse_args()
    use_persistent_compile_cache()
    from transformers import Qwen2Config

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    max_length, scale = (2048, 1.0) if not args.smoke else (256, 0.1)
    if args.smoke:
        args.steps, args.warmup, args.budgets = 2, 1, [512]
        args.variants = [v for v in args.variants if v != "packed-flex"]
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
    else:
        cfg = Qwen2Config(**SHAPES["1.5b"], max_position_embeddings=32768, rope_theta=1e6)
    ligers = {"off": [False], "on": [True], "both": [False, True]}[args.liger]
    if True in ligers:
        try:
            check_liger(cfg.model_type, device.type == "cuda")
        except ValueError as error:
            parser.exit(2, f"error: {error}\n")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="tcp://127.0.0.1:29555",
                            rank=0, world_size=1)
    rows = synthetic_rows(args.batch * (args.warmup + args.steps), cfg.vocab_size, max_length, scale)
    for liger in ligers:
        if "original" in args.variants:
            measure("original: micro 1, padded to max_length", cfg, "sdpa", rows,
                    lambda idx, lens: plan_padded(idx, lens, 1, 1), max_length, None, args, device, liger)
        for budget in args.budgets:
            plan = lambda idx, lens, b=budget: plan_packed(idx, lens, 1, b)
            if "packed-sdpa" in args.variants:
                measure(f"packed {budget} tokens", cfg, "sdpa", rows, plan, None, 0, args, device, liger)
            if "packed-flex" in args.variants:
                measure(f"packed {budget} tokens, rows padded to x{args.multiple}", cfg, "flex_attention", rows,
                        plan, None, args.multiple, args, device, liger)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

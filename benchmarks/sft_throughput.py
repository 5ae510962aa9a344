"""SFT throughput: our packed batching vs the original recipe's (micro batch 1, every row padded to 2048).

Runs the trainer's own pieces (FSDP2 `shard` with bf16 mixed precision, `plan_packed`/`plan_padded`,
`collate_*`, `token_loss_sum`, AdamW, clipping) on one device, on a model of `--shape` (Qwen2.5-1.5B by default,
`smollm2-135m` for issue 42's SFT epoch) with random weights (no download) and synthetic SPA-shaped rows: prompts
U(400, 1800) tokens, responses U(60, 250) + eos. Prints one JSON line per variant: useful (non-padding) tokens/s
(median over timed steps), MFU, and the step's phases (`phases_s`, medians; each phase ends with a device
synchronization): `data` (plan, collate, copy to the device), `fwd_bwd`, `clip` (the gradient norm, read on the
host as the trainer does) and `optim` (AdamW's step and zero_grad).

    python benchmarks/sft_throughput.py                 # GPU: original vs packed (sdpa, flex_attention)
    python benchmarks/sft_throughput.py --smoke         # tiny model on CPU, a few steps
    python benchmarks/sft_throughput.py --variants packed-flex --budgets 16384 --multiple 512 --liger both
                                                        # GPU: plain, then Liger kernels (model.use_liger=true)
    python benchmarks/sft_throughput.py --shape smollm2-135m --variants packed-varlen --budgets 16384 --fused both
                                                        # issue 42: SmolLM2's SFT step, AdamW foreach vs fused

`packed-varlen` is `model.attn_implementation=packed_sdpa` (the trainer's packed attention: flash attention's
variable-length kernel on a GPU, SDPA per row elsewhere); `packed-sdpa` is transformers' own SDPA on the packed rows.

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

from sft.fsdp_model import place
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


def build(cfg, attn: str, device: torch.device, liger: bool, fsdp: bool = True):
    """(model, the context its forward passes run in), placed as the trainer places it (`sft.fsdp_model.place`)."""
    from transformers import Qwen2ForCausalLM

    from SPA_agent.trainer.packing import avoid_cudnn_attention, enable_packed_attention

    varlen = attn == "packed_sdpa"
    cfg._attn_implementation = "sdpa" if varlen else attn
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(cfg)
    model.config.use_cache = False
    if varlen:  # as sft/fsdp_model.load_model does for attn_implementation=packed_sdpa
        enable_packed_attention(model)
        avoid_cudnn_attention()
    if liger:
        apply_liger(model)
    return place(model, init_device_mesh(device.type, (1,)), device, fsdp)


def step(model, optimizer, rows, plan, pad_to, packed_pad, device, loss_sum) -> dict[str, float]:
    """One optimizer step as SftTrainer.train_step does it (one rank); returns each phase's seconds."""
    phases, start = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal start
        if device.type == "cuda":
            torch.cuda.synchronize()
        phases[name], start = time.perf_counter() - start, time.perf_counter()

    if packed_pad is None:
        batches = [collate_padded([rows[i] for i in m], 0, pad_to) for m in plan[0]]
    else:
        batches = [collate_packed([rows[i] for i in m], 0, packed_pad) for m in plan[0]]
    n_loss = sum(count_loss_tokens(b) for b in batches)
    batches = [{k: v.to(device, non_blocking=True) for k, v in batch.items()} for batch in batches]
    lap("data")
    for batch in batches:
        loss = loss_sum(model, batch)
        (loss / n_loss).backward()
    lap("fwd_bwd")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    lap("clip")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lap("optim")
    return phases


def measure(name, cfg, attn, rows, make_plan, pad_to, packed_pad, args, device, liger: bool,
            fused: bool = False, fsdp: bool = True) -> dict:
    model, compute = build(cfg, attn, device, liger, fsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.01,
                                  fused=fused or None)
    plain_loss_sum = (lambda m, b: fused_token_loss_sum(m, b, args.liger_chunk_mem_const)) if liger \
        else token_loss_sum

    def loss_sum(m, b):
        with compute():
            return plain_loss_sum(m, b)
    times, tokens, flops, trained_flops, first_step, phases = [], [], [], [], None, []
    for k in range(args.warmup + args.steps):
        batch_rows = rows[(k * args.batch) % len(rows):][:args.batch]
        plan = make_plan(list(range(len(batch_rows))), [len(r) for r in batch_rows])
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step_phases = step(model, optimizer, batch_rows, plan, pad_to, packed_pad, device, loss_sum)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if k == 0:
            first_step = time.perf_counter() - start
        if k >= args.warmup:
            times.append(time.perf_counter() - start)
            phases.append(step_phases)
            tokens.append(sum(len(r) for r in batch_rows))
            flops.append(flops_per_step(batch_rows, cfg))
            trained_flops.append(flops_per_step(batch_rows, cfg, trained_logits_only=True))
    if args.profile:  # one more step under the profiler: operator tables by own GPU and own host time
        from torch.profiler import ProfilerActivity, profile

        batch_rows = rows[:args.batch]
        plan = make_plan(list(range(len(batch_rows))), [len(r) for r in batch_rows])
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step(model, optimizer, batch_rows, plan, pad_to, packed_pad, device, loss_sum)
        for key in (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70), flush=True)
    rates = [t / s for t, s in zip(tokens, times)]
    mfu = [f / s / PEAK_FLOPS for f, s in zip(flops, times)]
    mfu_trained = [f / s / PEAK_FLOPS for f, s in zip(trained_flops, times)]
    result = {"metric": "sft_useful_tokens_per_s", "variant": name, "attn": attn, "liger": liger, "fused_adamw": fused,
              "fsdp": fsdp,
              "phases_s": {p: round(statistics.median(s[p] for s in phases), 4) for p in phases[0]},
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
    parser.add_argument("--shape", choices=["1.5b", "0.5b", "smollm2-135m"], default="1.5b",
                        help="model layout (random weights)")
    parser.add_argument("--variants", nargs="+", default=["original", "packed-sdpa", "packed-flex"],
                        choices=["original", "packed-sdpa", "packed-varlen", "packed-flex"])
    parser.add_argument("--fsdp", choices=["on", "off", "both"], default="on",
                        help="FSDP2 with bf16 mixed precision (the trainer's), or a plain float32 module under bf16 "
                             "autocast (the PPO trainer's local backend), or both in turn")
    parser.add_argument("--fused", choices=["off", "on", "both"], default="off",
                        help="AdamW's fused CUDA kernel (off: PyTorch's default, foreach), or both in turn")
    parser.add_argument("--liger", choices=["off", "on", "both"], default="off",
                        help="Liger kernels (model.use_liger): off, on, or both (plain first); GPU only")
    parser.add_argument("--profile", action="store_true",
                        help="after each variant's timed steps, one more step under torch's profiler: its operator "
                             "tables by own GPU time and by own host time")
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
        cfg = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=32768, rope_theta=1e6)
    ligers = {"off": [False], "on": [True], "both": [False, True]}[args.liger]
    if True in ligers:
        try:
            check_liger(cfg.model_type, device.type == "cuda")
        except ValueError as error:
            parser.exit(2, f"error: {error}\n")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="tcp://127.0.0.1:29555",
                            rank=0, world_size=1)
    rows = synthetic_rows(args.batch * (args.warmup + args.steps), cfg.vocab_size, max_length, scale)
    fuseds = {"off": [False], "on": [True], "both": [False, True]}[args.fused]
    if True in fuseds and device.type != "cuda":
        parser.exit(2, "error: --fused needs a CUDA GPU\n")
    packed = {"packed-sdpa": ("sdpa", 0), "packed-varlen": ("packed_sdpa", 0),
              "packed-flex": ("flex_attention", args.multiple)}
    fsdps = {"on": [True], "off": [False], "both": [True, False]}[args.fsdp]
    for liger, fsdp in [(liger, fsdp) for liger in ligers for fsdp in fsdps]:
        for fused in fuseds:
            if "original" in args.variants:
                measure("original: micro 1, padded to max_length", cfg, "sdpa", rows,
                        lambda idx, lens: plan_padded(idx, lens, 1, 1), max_length, None, args, device, liger, fused,
                        fsdp)
            for budget in args.budgets:
                plan = lambda idx, lens, b=budget: plan_packed(idx, lens, 1, b)
                for variant in [v for v in args.variants if v in packed]:
                    attn, multiple = packed[variant]
                    name = f"{variant} {budget} tokens" + (f", rows padded to x{multiple}" if multiple else "")
                    measure(name, cfg, attn, rows, plan, None, multiple, args, device, liger, fused, fsdp)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

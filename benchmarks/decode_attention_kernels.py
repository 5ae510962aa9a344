"""The decode attention kernels alone at SmolLM2-135M's decode shapes, with their launch parameters swept (issue 42).

In lease 6's profile of one rollout on an H200 (split_kv), its partial kernel (`_partials` then,
split_kv_kernels.partials now) took 56 µs a call, 2-5x the time the keys and values it reads take at the H200's
bandwidth. This times, for each case (a turn's longest row × the KV buffer's length ×
the share of finished rows), each variant:

- `flash`: flash attention's variable-length forward as the static decoder calls it (`flash_decode`; CUDA only);
- `split_kv` over the grid --splits × --blocks × --warps (split_kv_decode.py's SPLIT, BLOCK_N, NUM_WARPS), then at
  the defaults with each --stages (num_stages), each --max-splits (the grid capped at that many programs per row and
  key/value head, whatever the buffer's length: the fix for launching programs past every row's end in a long kept
  buffer, graph-safe) and with the grid's heads first (`heads_first`: neighbouring programs read neighbouring bytes);
- `split_kv_shared` (shared_prefix_decode.py, SmolLM2's default) at the defaults and with each --max-splits: rows
  in groups of --group sharing their first --prefix keys, read once a group.

Inputs: batch 256 (32 puzzles × 8 samples), 9 query / 3 key-value heads, head size 64, bf16; cache (B, L, H_kv, D)
with L each --buffers (2048: about a last turn's own buffer; 4096: a kept buffer, which grows to at least twice the
longest call's keys); a case's running rows
read between 7/8 of --turns keys and all of them (the longest row reads exactly that), a --finished share read one
key (rows that ended their turn), and the rows of a group hold the same first --prefix keys and values (so every
kernel computes the same attention). --copies sets of keys and values are cycled so that a call does not find the
last call's in the 50 MB L2 (a decode step reads 30 layers' in turn).

Timing: --reps calls captured in one CUDA graph (as the decoder replays them), replayed --iters times between CUDA
events; µs a call. GB/s: the keys and values the rows read (sum of lengths × H_kv × D × 2 × bytes), per second, for
every variant alike (split_kv_shared reads fewer: the prefix once a group). Each variant's output is checked against
the masked reference (SDPA in float32, masked_decode); the script exits 1 if an error exceeds --tolerance. A
markdown table (one row a variant, µs per case) goes to stdout, one JSON line per (case, variant) to --json (a
"setup" line first, a "summary" line last).

    python benchmarks/decode_attention_kernels.py --json decode_attention.jsonl
    python benchmarks/decode_attention_kernels.py --smoke --json /tmp/smoke.jsonl  # CPU, ~10 s

On one H200 the default run should take 1-2 minutes (not yet measured): most of it Triton's compiles (~70 kernel
specialisations, most in the first case), then 16 cases x 42 variants of ~20 ms each. It uses the current CUDA device
(CUDA_VISIBLE_DEVICES picks an idle one) and ~5 GB of its memory. Fewer values of --splits/--blocks/--warps/--turns
make it shorter.

--smoke: tiny shapes (8 rows, 2/1 heads, head size 16, float32) on the CPU under Triton's interpreter (set here if
unset), a few variants, one call timed each: the script's paths run and are checked; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's SPA_agent without PYTHONPATH

#: --smoke: Triton's interpreter runs a program at a time (~10 ms each), so few programs: one group of 8 rows, one
#: key/value head of 2 query heads, 3 splits of a 96-key buffer
SMOKE = dict(batch=8, heads=2, kv_heads=1, head_dim=16, dtype="float32", turns=[80], buffers=[96], finished=[0.25],
             prefix=20, splits=[32], blocks=[16, 32], warps=[4], stages=[2], max_splits=[1], reps=1, iters=1,
             copies=1, tolerance=1e-4)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256, help="rows (32 puzzles x 8 samples)")
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads (SmolLM2-135M: 3)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--turns", type=int, nargs="+", default=[560, 900, 1250, 1600],
                        help="keys the longest row reads, a case each (SmolLM2's 4 turns)")
    parser.add_argument("--buffers", type=int, nargs="+", default=[2048, 4096], help="KV buffer lengths L")
    parser.add_argument("--finished", type=float, nargs="+", default=[0.0, 0.6],
                        help="shares of rows finished (one key read); ~0.6 is a SmolLM2 turn's mean")
    parser.add_argument("--group", type=int, default=8, help="rows a group sharing a prefix (split_kv_shared)")
    parser.add_argument("--prefix", type=int, default=550, help="keys a group shares (SmolLM2's first prompt)")
    parser.add_argument("--splits", type=int, nargs="+", default=[128, 256, 512], help="split_kv's SPLIT values")
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128], help="split_kv's BLOCK_N values")
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8], help="split_kv's num_warps values")
    parser.add_argument("--stages", type=int, nargs="*", default=[1, 2, 3, 4], help="num_stages, at the defaults")
    parser.add_argument("--max-splits", type=int, nargs="*", default=[1, 2, 4, 8],
                        help="grid caps (programs per row and head), at the defaults, split_kv and split_kv_shared")
    parser.add_argument("--no-flash", action="store_true", help="leave out flash attention's varlen kernel")
    parser.add_argument("--reps", type=int, default=60, help="calls captured in one CUDA graph")
    parser.add_argument("--iters", type=int, default=3, help="replays of that graph timed")
    parser.add_argument("--copies", type=int, default=4, help="sets of keys/values cycled (beat the L2)")
    parser.add_argument("--eager", action="store_true", help="time eager launches, no CUDA graph")
    parser.add_argument("--tolerance", type=float, default=2e-2, help="largest abs error from the reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write one JSON line per measurement here")
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
    if args.batch % args.group or args.heads % args.kv_heads:
        parser.error("--batch must be a multiple of --group and --heads of --kv-heads")
    return args


def variants(args) -> list[tuple[str, str, dict]]:
    """(name, kernel, launch parameters) of every variant timed."""
    out = [] if args.no_flash else [("flash", "flash", {})]
    for split in args.splits:
        for block_n in args.blocks:
            for warps in args.warps:
                if block_n <= split and split % block_n == 0:
                    out.append((f"split_kv s{split} b{block_n} w{warps}", "split_kv",
                                dict(split=split, block_n=block_n, num_warps=warps)))
    out += [(f"split_kv stages{stages}", "split_kv", dict(num_stages=stages)) for stages in args.stages]
    out += [(f"split_kv max_splits{cap}", "split_kv", dict(max_splits=cap)) for cap in args.max_splits]
    out.append(("split_kv heads_first", "split_kv", dict(heads_first=True)))
    out.append(("split_kv_shared", "split_kv_shared", {}))
    out += [(f"split_kv_shared max_splits{cap}", "split_kv_shared", dict(max_splits=cap)) for cap in args.max_splits]
    return out


def row_lengths(torch, batch: int, longest: int, prefix: int, finished: float, gen):
    """Running rows read between 7/8 of `longest` keys (at least the prefix and one more) and `longest`, the first
    running row exactly `longest`; a `finished` share of the rows, drawn at random, one key."""
    low = min(longest, max(prefix + 1, longest - longest // 8))
    lengths = torch.randint(low, longest + 1, (batch,), generator=gen, dtype=torch.int32)
    done = torch.randperm(batch, generator=gen)[: round(finished * batch)]
    lengths[done] = 1
    running = (lengths > 1).nonzero()
    if len(running):
        lengths[running[0, 0]] = longest
    return lengths


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import triton

    from SPA_agent.generators import split_kv_decode as skv
    from SPA_agent.generators.shared_prefix_decode import PrefixTables, shared_prefix_decode
    from SPA_agent.generators.static_decode import flash_decode, masked_decode, uses_flash_decode

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no CUDA GPU: run with --smoke (or TRITON_INTERPRET=1) on a CPU")
    dtype = getattr(torch, args.dtype)
    graphs = device.type == "cuda" and not args.eager
    batch, heads, kv_heads, head_dim, group = args.batch, args.heads, args.kv_heads, args.head_dim, args.group
    scale = 1.0 / math.sqrt(head_dim)
    defaults = dict(split=skv.SPLIT, block_n=skv.BLOCK_N, num_warps=skv.NUM_WARPS, num_stages=skv.NUM_STAGES,
                    max_splits=skv.MAX_SPLITS)
    started = time.perf_counter()
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115 (closed at the end)

    def emit(row: dict) -> None:
        if sink:  # line by line: a run stopped early keeps what it measured
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    emit({"metric": "setup", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
          "torch": torch.__version__, "triton": triton.__version__, "graphs": graphs, "batch": batch,
          "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": args.dtype, "group": group,
          "prefix": args.prefix, "defaults": defaults})

    def call(kernel: str, params: dict, inputs: dict, copy: int):
        q, k, v, lengths = inputs["query"], inputs["keys"][copy], inputs["values"][copy], inputs["lengths"]
        if kernel == "flash":
            return flash_decode(q, k, v, lengths, inputs["cu_q"], inputs["cu_k"], scale)
        if kernel == "split_kv":
            return skv.split_kv_decode(q, k, v, lengths, scale, **params)
        return shared_prefix_decode(q, k, v, lengths, inputs["tables"], scale, **params)

    def time_us(kernel: str, params: dict, inputs: dict) -> float:
        copies = len(inputs["keys"])
        if not graphs:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for rep in range(args.reps):
                call(kernel, params, inputs, rep % copies)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1e6 / args.reps
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for copy in range(copies):
                call(kernel, params, inputs, copy)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for rep in range(args.reps):
                call(kernel, params, inputs, rep % copies)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            graph.replay()
        end.record()
        end.synchronize()
        del graph
        return start.elapsed_time(end) * 1e3 / (args.reps * args.iters)

    table: dict[str, dict[str, float]] = {}
    errors: dict[str, float] = {}
    rates: dict[str, list[float]] = {}
    cases: list[str] = []
    failed = []
    runs = variants(args)
    gen = torch.Generator().manual_seed(args.seed)
    for length in args.buffers:
        # keys and values: each group's members hold their leader's first `prefix` keys and values
        shape = (args.copies, batch // group, group, length, kv_heads, head_dim)
        keys, values = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
        for cache in (keys, values):
            cache[:, :, 1:, : args.prefix] = cache[:, :, :1, : args.prefix]
        keys, values = (cache.view(args.copies, batch, length, kv_heads, head_dim) for cache in (keys, values))
        query = torch.randn(batch, 1, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
        tables = PrefixTables(batch, device)
        tables.fill([args.prefix] * batch, [list(range(start, start + group)) for start in range(0, batch, group)])
        rows = torch.arange(batch + 1, dtype=torch.int32, device=device)
        for longest in args.turns:
            if longest > length:
                continue
            for finished in args.finished:
                lengths = row_lengths(torch, batch, longest, args.prefix, finished, gen).to(device)
                inputs = dict(query=query, keys=keys, values=values, lengths=lengths, tables=tables.tensors,
                              cu_q=rows * (heads // kv_heads), cu_k=rows * length)
                reference = masked_decode(query.float(), keys[0].float(), values[0].float(), lengths, scale)
                read = int(lengths.sum()) * kv_heads * head_dim * 2 * keys.element_size()
                case = f"{longest}/{length}/f{finished:g}"
                cases.append(case)
                for name, kernel, params in runs:
                    if kernel == "flash" and not uses_flash_decode(query):
                        continue
                    error = float((call(kernel, params, inputs, 0).float() - reference).abs().max())
                    us = time_us(kernel, params, inputs)
                    table.setdefault(name, {})[case] = us
                    errors[name] = max(errors.get(name, 0.0), error)
                    rates.setdefault(name, []).append(read / us / 1e3)
                    if not error <= args.tolerance:
                        failed.append((name, case, error))
                    emit({"metric": "decode_attention", "variant": name, "kernel": kernel, **defaults, **params,
                          "buffer": length, "longest": longest, "finished": finished,
                          "mean_keys": round(float(lengths.float().mean()), 1), "bytes": read, "us": round(us, 2),
                          "gb_s": round(read / us / 1e3, 1), "max_abs_err": error})
                us, name = min((times[case], name) for name, times in table.items() if case in times)
                print(f"case {case} (longest row/buffer/finished share, {read / 1e6:.0f} MB of keys and values): "
                      f"fastest {name}, {us:.1f} µs ({time.perf_counter() - started:.0f} s)", flush=True)
        del keys, values, inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\n| variant | {' | '.join(f'{case} µs' for case in cases)} | mean GB/s | max abs err |")
    print(f"|---|{'---|' * len(cases)}---|---|")
    for name, times in table.items():
        cells = " | ".join(f"{times[case]:.1f}" if case in times else "" for case in cases)
        print(f"| {name} | {cells} | {statistics.mean(rates[name]):.0f} | {errors[name]:.1e} |")
    emit({"metric": "summary", "variants": len(table), "cases": len(cases), "failed": len(failed),
          "seconds": round(time.perf_counter() - started, 1)})
    if sink:
        sink.close()
    for name, case, error in failed:
        print(f"ERROR {name} at {case}: max abs error {error:.3g} > {args.tolerance}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

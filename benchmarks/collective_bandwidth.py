"""Bandwidth of the collectives FSDP runs between the GPUs of one machine (issue 28): all-gather and
reduce-scatter of a tensor the size of a model's parameters, as FSDP issues them per forward (all-gather of the
bf16 parameters) and per backward (reduce-scatter of the gradients).

    torchrun --nproc_per_node 2 benchmarks/collective_bandwidth.py [--megabytes 1000] [--repeats 5]

Prints one JSON line per collective (rank 0): seconds per call (median of the repeats after a warm-up) and the
bus bandwidth in GB/s as nccl-tests reports it ((n-1)/n × bytes / seconds). Run it under the environment a
training job sees (e.g. NCCL_P2P_DISABLE=1, or inside a Ray worker) to compare the paths NCCL takes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: NCCL connects its channels on the first call
    torch.cuda.synchronize()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=1000.0, help="size of the whole (gathered) tensor")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available() or "RANK" not in os.environ:
        parser.exit(2, "error: run it with torchrun on a machine with CUDA GPUs\n")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    total = int(args.megabytes * 2**20) // (2 * world) * world  # bf16 elements, divisible by the ranks
    shard = torch.ones(total // world, dtype=torch.bfloat16, device="cuda")
    full = torch.empty(total, dtype=torch.bfloat16, device="cuda")
    collectives = {"all_gather": lambda: dist.all_gather_into_tensor(full, shard),
                   "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full)}
    for name, fn in collectives.items():
        seconds = timed(fn, args.repeats)
        nbytes = full.numel() * full.element_size()
        if rank == 0:
            print(json.dumps({"collective": name, "megabytes": round(nbytes / 2**20), "ranks": world,
                              "seconds": round(seconds, 5), "bus_gb_s": round((world - 1) / world * nbytes / seconds / 1e9, 1),
                              "device": torch.cuda.get_device_name(),
                              "p2p_disabled": os.environ.get("NCCL_P2P_DISABLE") == "1"}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

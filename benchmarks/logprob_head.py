"""verl's log-prob head without flash-attn against the chunked one of `SPA_agent/trainer/verl_backend/patches.py`
(issue 28), forward and backward.

    python benchmarks/logprob_head.py --tokens 80000 --vocab 860      # the 0.5B speed run's tokens per GPU pass
    python benchmarks/logprob_head.py --tokens 16384 --vocab 151936   # one Qwen micro-batch of token budget

verl's FSDP engine hands `logprobs_from_logits` (tokens, vocab) logits; where flash-attn's cross-entropy kernel is
missing it falls back to `logprobs_from_logits_v2`, which loops over the rows (tokens). Prints one JSON line per
function: seconds per forward + backward (median of --repeats after a warm-up) and the largest difference from
verl's result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from verl.utils.torch_functional import logprobs_from_logits_v2

from SPA_agent.trainer.verl_backend.patches import logprobs_from_logits


def timed(fn, logits: torch.Tensor, labels: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    seconds = []
    for _ in range(repeats + 1):  # the first is a warm-up
        x = logits.detach().requires_grad_()
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(x, labels)
        out.sum().backward()
        if x.is_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]), out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=80000)
    parser.add_argument("--vocab", type=int, default=860)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, device=args.device)
    labels = torch.randint(0, args.vocab, (args.tokens,), device=args.device)
    reference = None
    for name, fn in (("verl logprobs_from_logits_v2 (row loop)", logprobs_from_logits_v2),
                     ("verl_patches.logprobs_from_logits (chunked)", logprobs_from_logits)):
        seconds, out = timed(fn, logits, labels, args.repeats)
        reference = out if reference is None else reference
        print(json.dumps({"function": name, "tokens": args.tokens, "vocab": args.vocab, "device": args.device,
                          "seconds_fwd_bwd": round(seconds, 4),
                          "max_abs_diff_vs_verl": float((out - reference).abs().max())}), flush=True)


if __name__ == "__main__":
    main()

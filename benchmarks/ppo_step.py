"""One PPO step of the `local` backend at the paper's batch, phase by phase, with peak GPU memory (issue 6).

A Qwen2.5-0.5B-shaped Qwen2 model with random weights is built here (no download) and saved to a temporary
directory that the backend loads as actor, critic and reference. The rollout is synthetic but shaped like the
paper's: 32 groups × 8 = 256 trajectories, 5 turns, each turn an observation of --obs-len random ids followed by
up to --response-len (400) sampled tokens; a random-weight model almost never samples an end-of-turn id, so every
turn runs to the limit (an upper bound for generation). Generation goes through the backend's generator (`hf`,
the actor's live weights). The StarPO-S filter keeps 25% of the groups (64 trajectories), on which the old
log-probs, reference log-probs, values, critic update and actor update are timed (mini-batch 64,
--micro trajectories per micro-batch). Prints one JSON line per phase.

    python benchmarks/ppo_step.py                       # GPU, the paper's sizes, micro-batch 1
    python benchmarks/ppo_step.py --micro 4             # larger micro-batches
    python benchmarks/ppo_step.py --smoke               # CI size: tiny shape on CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from model_shapes import SHAPES
from verl import DataProto

from SPA_agent.config import compose
from SPA_agent.generators.base import Prompt
from SPA_agent.trainer import algos
from SPA_agent.trainer.local_backend import LocalBackend

EOS_IDS, PAD_ID = [1, 2], 0  # ids the random prompts never contain


class IdTokenizer:
    """Enough of a tokenizer for the generator: the model has no vocabulary, decoding writes the ids."""

    eos_token_id, pad_token_id = EOS_IDS[0], PAD_ID

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def save_random_model(shape: str, directory: Path) -> Path:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, eos_token_id=EOS_IDS[0],
                         pad_token_id=PAD_ID)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=EOS_IDS, pad_token_id=PAD_ID)
    model.save_pretrained(directory)
    return directory


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def phase(name: str, results: list[dict], **extra):
    """Time a phase and record its peak GPU memory; append one result and print it as a JSON line."""
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    yield
    sync()
    row = {"metric": f"ppo_step/{name}", "seconds": round(time.perf_counter() - start, 3), "unit": "s", **extra}
    if torch.cuda.is_available():
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    results.append(row)
    print(json.dumps(row), flush=True)


def generate_rollout(backend: LocalBackend, args, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Multi-turn generation of all trajectories; (ids, roles) per trajectory with role 1 on sampled tokens."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.trajectories)]
    roles = [[0] * args.prompt_len for _ in ids]
    for turn in range(args.turns):
        if turn:
            for row in range(len(ids)):
                observation = torch.randint(3, vocab, (args.obs_len,), generator=g).tolist()
                ids[row] += observation
                roles[row] += [0] * len(observation)
        generations = backend.generate([Prompt(messages=[], prompt_ids=list(row)) for row in ids])
        for row, generation in enumerate(generations):
            ids[row] += generation.token_ids
            roles[row] += [1] * len(generation.token_ids)
    return ids, roles


def training_batch(ids: list[list[int]], roles: list[list[int]], keep: int) -> DataProto:
    """The filtered batch as the driver builds it: left padded, response_mask := loss_mask (assistant tokens)."""
    ids, roles = ids[:keep], roles[:keep]
    width = max(map(len, ids))
    input_ids = torch.full((keep, width), PAD_ID, dtype=torch.long)
    sampled = torch.zeros((keep, width))
    attention_mask = torch.zeros((keep, width), dtype=torch.long)
    for row, (row_ids, row_roles) in enumerate(zip(ids, roles)):
        input_ids[row, width - len(row_ids):] = torch.tensor(row_ids)
        sampled[row, width - len(row_ids):] = torch.tensor(row_roles, dtype=torch.float32)
        attention_mask[row, width - len(row_ids):] = 1
    mask = sampled[:, 1:]
    scores = torch.zeros_like(mask)
    last = (mask.shape[1] - 1) - mask.flip(-1).argmax(-1)
    scores[torch.arange(keep), last] = torch.rand(keep)
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": input_ids[:, 1:],
        "response_mask": mask, "assistant_mask": mask, "loss_mask": mask, "token_level_scores": scores,
    })


def train_phases(backend: LocalBackend, batch: DataProto, results: list[dict], tokens: int) -> None:
    with phase("old_log_prob", results, tokens=tokens):
        batch = batch.union(backend.compute_log_prob(batch))
    with phase("ref", results, tokens=tokens):
        batch = batch.union(backend.compute_ref_log_prob(batch))
    with phase("values", results, tokens=tokens):
        batch = batch.union(backend.compute_values(batch))
    t = batch.batch
    t["advantages"], t["returns"] = algos.gae(t["token_level_scores"], t["values"], t["response_mask"], 1.0, 1.0)
    with phase("update_critic", results, tokens=tokens):
        backend.update_critic(batch)
    with phase("update_actor", results, tokens=tokens):
        backend.update_actor(batch)


def build_backend(args, model_dir: Path) -> LocalBackend:
    overrides = [
        f"model_path={model_dir}", f"trainer.device={'cpu' if args.smoke else 'cuda'}", "generator=hf",
        "generator.progress=False", f"generator.batch_size={args.gen_batch}",
        f"actor_rollout_ref.rollout.response_length={args.response_len}",
        f"micro_batch_size_per_gpu={args.micro}", f"ppo_mini_batch_size={args.mini}",
        f"actor_rollout_ref.ref.offload_to_cpu={args.ref_on_cpu}",
    ]
    return LocalBackend(compose("_2_sokoban", overrides), IdTokenizer())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU, small batch (CI)")
    parser.add_argument("--trajectories", type=int, default=256, help="env_groups × group_size")
    parser.add_argument("--keep", type=int, default=64, help="trajectories left by the filter (ratio 0.25)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=300, help="tokens of system + first user message")
    parser.add_argument("--obs-len", type=int, default=60, help="tokens of each later user message")
    parser.add_argument("--response-len", type=int, default=400, help="max new tokens per turn")
    parser.add_argument("--micro", type=int, default=1, help="trajectories per micro-batch (paper: 1)")
    parser.add_argument("--mini", type=int, default=64, help="trajectories per optimizer step (paper: 64)")
    parser.add_argument("--gen-batch", type=int, default=64, help="sequences per generate call")
    parser.add_argument("--ref-on-cpu", action="store_true", help="actor_rollout_ref.ref.offload_to_cpu")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats of the training phases")
    args = parser.parse_args()
    if args.smoke:
        args.trajectories, args.keep, args.mini, args.turns = 8, 4, 4, 2
        args.prompt_len, args.obs_len, args.response_len, args.gen_batch = 32, 8, 16, 8
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on CPU")
    shape = "tiny" if args.smoke else "0.5b"
    with tempfile.TemporaryDirectory() as tmp:
        backend = build_backend(args, save_random_model(shape, Path(tmp)))
        results: list[dict] = []
        with phase("generation", results, trajectories=args.trajectories, turns=args.turns):
            ids, roles = generate_rollout(backend, args, SHAPES[shape]["vocab_size"])
        tokens = int(training_batch(ids, roles, args.keep).batch["attention_mask"].sum())
        for _ in range(args.repeats):  # a fresh batch each time: the phases add keys to it
            train_phases(backend, training_batch(ids, roles, args.keep), results, tokens)
    summary = {"metric": "ppo_step/total", "unit": "s", "shape": shape, "micro": args.micro,
               "sampled_tokens": sum(map(sum, roles)), "train_tokens": tokens,
               "seconds": round(sum(r["seconds"] for r in results if r["metric"] == "ppo_step/generation")
                                + sum(statistics.median(r["seconds"] for r in results if r["metric"] == m)
                                      for m in {r["metric"] for r in results} - {"ppo_step/generation"}), 3)}
    if torch.cuda.is_available():
        summary["peak_mem_gib"] = max(r["peak_mem_gib"] for r in results)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()

"""One PPO step of the `local` backend at the paper's batch, phase by phase, with peak GPU memory (issues 6, 17).

A model of the --model shape (Qwen2.5-0.5B or 1.5B, or the embedded `small` ~25M model's shape) with random
weights is built here (no download) and saved to a temporary directory that the backend loads as actor, critic
and reference. The rollout is synthetic but shaped like the paper's: 32 groups × 8 = 256 trajectories, 5 turns,
each turn an observation of --obs-len random ids followed by up to --response-len sampled tokens (400; 256 for
`small`, its preset's); a random-weight Qwen-vocabulary model almost never samples an end-of-turn id, so every
turn runs to the limit (an upper bound for generation). Generation goes through the backend's generator (`hf`,
the actor's live weights, one generate call per turn for all trajectories as the agent proxy does). The StarPO-S
filter keeps 25% of the groups (64 trajectories), on which the old log-probs, reference log-probs, values,
critic update and actor update are timed (mini-batch 64). Micro-batches follow the config's defaults (packed,
token budgets: --budget, --forward-budget) unless --micro N asks for the padded path of N trajectories each
(the paper's recipe is --micro 1). Prints one JSON line per phase (seconds, peak GPU memory) and a total;
--json writes them all to a file.

    python benchmarks/ppo_step.py --model 0.5b          # GPU, the paper's sizes, packed token budgets
    python benchmarks/ppo_step.py --model small         # the small preset's shape
    python benchmarks/ppo_step.py --model 0.5b --micro 1 --gen-batch 64   # the earlier recipe (baseline)
    python benchmarks/ppo_step.py --smoke               # CI size: tiny shape on CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from model_shapes import SHAPES
from verl import DataProto

from SPA_agent.config import compose
from SPA_agent.generators.base import Prompt
from SPA_agent.trainer import algos
from SPA_agent.trainer.local_backend.backend import LocalBackend
from SPA_agent.trainer.metrics import operator_table

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
def phase(name: str, results: list[dict], profile: str | None = None, **extra):
    """Time a phase and record its peak GPU memory; append one result and print it as a JSON line. When
    `profile` names this phase, also print its kernel table (the time then includes the profiler's overhead)."""
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with operator_table(name) if profile == name else nullcontext():
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


def train_phases(backend: LocalBackend, batch: DataProto, results: list[dict], tokens: int,
                 profile: str | None = None) -> None:
    with phase("old_log_prob", results, profile, tokens=tokens):
        batch = batch.union(backend.compute_log_prob(batch))
    with phase("ref", results, profile, tokens=tokens):
        batch = batch.union(backend.compute_ref_log_prob(batch))
    with phase("values", results, profile, tokens=tokens):
        batch = batch.union(backend.compute_values(batch))
    t = batch.batch
    t["advantages"], t["returns"] = algos.gae(t["token_level_scores"], t["values"], t["response_mask"], 1.0, 1.0)
    with phase("update_critic", results, profile, tokens=tokens):
        backend.update_critic(batch)
    with phase("update_actor", results, profile, tokens=tokens):
        backend.update_actor(batch)


def micro_batch_overrides(args) -> list[str]:
    """--micro N: the padded path, N trajectories per micro-batch; else packed token-budget micro-batches."""
    if args.micro is not None:
        return ["use_dynamic_bsz=False", f"micro_batch_size_per_gpu={args.micro}",
                "actor_rollout_ref.model.use_remove_padding=False", "critic.model.use_remove_padding=False"]
    return ["use_dynamic_bsz=True", "actor_rollout_ref.model.use_remove_padding=True",
            "critic.model.use_remove_padding=True",
            *([f"ppo_max_token_len_per_gpu={args.budget}"] if args.budget else []),
            *([f"log_prob_max_token_len_per_gpu={args.forward_budget}"] if args.forward_budget else [])]


def build_backend(args, model_dir: Path) -> LocalBackend:
    overrides = [
        *(["model=small"] if args.model == "small" and not args.smoke else []),  # the preset's PPO settings
        f"model_path={model_dir}", f"trainer.device={'cpu' if args.smoke else 'cuda'}", "generator=hf",
        "generator.progress=False",
        f"generator.batch_size={'auto' if args.gen_batch is None else args.gen_batch}",
        f"generator.max_batch_tokens={args.gen_tokens}",
        f"actor_rollout_ref.rollout.response_length={args.response_len}", f"ppo_mini_batch_size={args.mini}",
        f"actor_rollout_ref.ref.offload_to_cpu={args.ref_on_cpu}", *micro_batch_overrides(args),
        *args.override,
    ]
    return LocalBackend(compose("_2_sokoban", overrides), IdTokenizer())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU, small batch (CI)")
    parser.add_argument("--model", choices=("0.5b", "1.5b", "small"), default="0.5b", help="model shape")
    parser.add_argument("--json", type=Path, help="also write every result line to this file (a JSON list)")
    parser.add_argument("--trajectories", type=int, default=256, help="env_groups × group_size")
    parser.add_argument("--keep", type=int, default=64, help="trajectories left by the filter (ratio 0.25)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=300, help="tokens of system + first user message")
    parser.add_argument("--obs-len", type=int, default=60, help="tokens of each later user message")
    parser.add_argument("--response-len", type=int, help="max new tokens per turn (400; small: 256)")
    parser.add_argument("--micro", type=int, help="padded micro-batches of this many trajectories (paper: 1); "
                                                  "default: packed token-budget micro-batches")
    parser.add_argument("--budget", type=int, help="ppo_max_token_len_per_gpu (update micro-batches)")
    parser.add_argument("--forward-budget", type=int, help="log_prob_max_token_len_per_gpu (no-grad passes)")
    parser.add_argument("--mini", type=int, default=64, help="trajectories per optimizer step (paper: 64)")
    parser.add_argument("--gen-batch", type=int, help="most sequences per decode batch (default: auto, no limit "
                                                      "on GPU)")
    parser.add_argument("--gen-tokens", default="auto", help="generator.max_batch_tokens (auto, null or an int)")
    parser.add_argument("--ref-on-cpu", action="store_true", help="actor_rollout_ref.ref.offload_to_cpu")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats of the training phases")
    parser.add_argument("--profile", choices=("old_log_prob", "ref", "values", "update_critic", "update_actor"),
                        help="print the GPU kernel table of this training phase (its last repeat)")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more config overrides, applied last (e.g. "
                             "actor_rollout_ref.model.enable_gradient_checkpointing=False)")
    args = parser.parse_args()
    if args.smoke:
        args.trajectories, args.keep, args.mini, args.turns = 8, 4, 4, 2
        args.prompt_len, args.obs_len, args.response_len = 32, 8, 16
        args.budget = args.budget or 64  # several packed micro-batches even at this size
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on CPU")
    shape = "tiny" if args.smoke else args.model
    if args.response_len is None:
        args.response_len = 256 if shape == "small" else 400
    with tempfile.TemporaryDirectory() as tmp:
        backend = build_backend(args, save_random_model(shape, Path(tmp)))
        results: list[dict] = []
        with phase("generation", results, trajectories=args.trajectories, turns=args.turns):
            ids, roles = generate_rollout(backend, args, SHAPES[shape]["vocab_size"])
        tokens = int(training_batch(ids, roles, args.keep).batch["attention_mask"].sum())
        for repeat in range(args.repeats):  # a fresh batch each time: the phases add keys to it
            train_phases(backend, training_batch(ids, roles, args.keep), results, tokens,
                         args.profile if repeat == args.repeats - 1 else None)
    summary = {"metric": "ppo_step/total", "unit": "s", "shape": shape,
               "micro": args.micro if args.micro is not None else "packed",
               **({} if args.micro is not None else {
                   "budget": backend.cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu,
                   "forward_budget": backend.cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu}),
               "gen_batch": args.gen_batch or "auto", "gen_tokens": args.gen_tokens, "overrides": args.override,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__,
               "sampled_tokens": sum(map(sum, roles)), "train_tokens": tokens,
               "seconds": round(sum(r["seconds"] for r in results if r["metric"] == "ppo_step/generation")
                                + sum(statistics.median(r["seconds"] for r in results if r["metric"] == m)
                                      for m in {r["metric"] for r in results} - {"ppo_step/generation"}), 3)}
    if torch.cuda.is_available():
        summary["peak_mem_gib"] = max(r["peak_mem_gib"] for r in results)
    print(json.dumps(summary), flush=True)
    if args.json:
        args.json.write_text(json.dumps([*results, summary], indent=1) + "\n")


if __name__ == "__main__":
    main()

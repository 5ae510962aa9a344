"""PPO steps of SmolLM2-135M-Instruct on Sokoban (or FrozenLake: --config _3_frozen_lake), phase by phase, on one GPU
(issue 42).

The real pipeline (config `_2_sokoban model=smollm2-135m`, or --config's, the base prompt mode of the original's PPO,
the config's batch of 32 groups × 8), built as `main_ppo` builds it, from --model-path (an SFT checkpoint, or
`smollm2-135m` for the base model). Runs --steps PPO steps, then one validation of 128 puzzles × --val-samples;
prints one JSON line per step with every phase's seconds (`timing_s/<phase>`, the trainer's own), the generator's
calls, prefill tokens (and those reused from the cache: generator.reuse_prefix_cache), decode steps, sampled tokens
and CUDA-graph capture time, and the time inside the generator (`gen_model_s`, the rest of `gen` is the rollout's
host work: prompts, parsing, env steps, the batch). The summary line holds the median of each phase over the steady
steps (all but the first), their sum (`total`) and the validation's seconds.

    python benchmarks/smollm2_step.py --model-path <sft checkpoint> --steps 4 --json out.json
    python benchmarks/smollm2_step.py --model-path <dir> --profile step   # + operator tables of one more step
    python benchmarks/smollm2_step.py --model-path <dir> --profile train  # the same, its training passes alone
    python benchmarks/smollm2_step.py --smoke                             # CI size: tiny model on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from SPA_agent.config import compose
from SPA_agent.runs.dir_lock import DirLock
from SPA_agent.trainer.main_ppo import build_trainer
from SPA_agent.trainer.metrics import PhaseTimer


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class DecoderPhases:
    """The static decoder's prefill and decode loop timed apart (a device sync before and after each; the decoder
    syncs at both ends of a call anyway), one record a decoder call: its rows, prompt lengths, prefill and decode
    seconds and decode steps. Pipelined turns prefill inside their decode loop: there `decode_s` is absent and the
    call's prefills, whole prompts and (generator.reuse_prefix_cache) suffixes past the cached ids alike, are summed
    into `prefill_s`."""

    def __init__(self, decoder):
        self.decoder, self.calls = decoder, []
        self._prefill, self._decode = decoder._prefill, decoder._decode
        self._prefill_suffixes = decoder._prefill_suffixes
        decoder._prefill, decoder._decode = self.prefill, self.decode
        decoder._prefill_suffixes = self.prefill_suffixes

    def prefill(self, state, prompts, lengths, *args, **kwargs):
        return self._timed(lengths.tolist(), self._prefill, state, prompts, lengths, *args, **kwargs)

    def prefill_suffixes(self, state, rows, prompts, offsets):
        return self._timed([len(ids) for ids in prompts], self._prefill_suffixes, state, rows, prompts, offsets)

    def _timed(self, prompt_lengths: list[int], prefill, *args, **kwargs):
        """`prefill(*args, **kwargs)` between device syncs, recorded as one call of `prompt_lengths`' prompts."""
        sync()
        start, steps = time.perf_counter(), self.decoder.stats.decode_steps
        logits = prefill(*args, **kwargs)
        sync()
        self.calls.append({"rows": len(prompt_lengths), "prompt_max": max(prompt_lengths),
                           "prompt_mean": round(statistics.mean(prompt_lengths), 1),
                           "prefill_s": round(time.perf_counter() - start, 4), "_steps": steps})
        return logits

    def decode(self, *args, **kwargs):
        sync()
        start = time.perf_counter()
        tokens = self._decode(*args, **kwargs)
        sync()
        call = self.calls[-1]
        call["decode_s"] = round(time.perf_counter() - start, 4)
        call["decode_steps"] = self.decoder.stats.decode_steps - call["_steps"]
        return tokens

    def take(self) -> dict:
        """Totals and per-call records since the last take."""
        calls, self.calls = self.calls, []
        for call in calls:
            call.pop("_steps")
        return {"prefill_s": round(sum(c["prefill_s"] for c in calls), 3),
                "decode_s": round(sum(c.get("decode_s", 0.0) for c in calls), 3), "decoder_calls": calls}


class TimedGenerator:
    """The rollout's generator (the backend), with the seconds spent in it and the tokens it sampled; with the
    static decoder, its prefill and decode loop apart (`DecoderPhases`)."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls, self.sequences, self.sampled = inner, 0.0, 0, 0, 0
        generator = getattr(inner, "generator", None)
        static = getattr(generator, "decoder", None) == "static"
        self.phases = DecoderPhases(generator._static_decoder()) if static else None

    def generate(self, prompts):
        sync()
        start = time.perf_counter()
        generations = self.inner.generate(prompts)
        sync()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.sequences += len(prompts)
        self.sampled += sum(len(g.token_ids) for g in generations)
        return generations

    @property
    def can_serve(self) -> bool:
        return bool(getattr(self.inner, "can_serve", False))

    def serve(self, prompts, respond):
        """Pipelined turns (agent_proxy.pipeline_turns): one call a rollout, every turn's generation counted."""
        def counted(row, generation):
            self.sequences += 1
            self.sampled += len(generation.token_ids)
            return respond(row, generation)

        sync()
        start = time.perf_counter()
        self.inner.serve(prompts, counted)
        sync()
        self.seconds += time.perf_counter() - start
        self.calls += 1

    def take(self) -> dict:
        """Counters since the last take, with the static decoder's."""
        decoder = getattr(self.inner.generator, "_static", None)
        stats = decoder.stats if decoder is not None else None
        row = {"gen_model_s": round(self.seconds, 3), "gen_calls": self.calls, "gen_sequences": self.sequences,
               "sampled_tokens": self.sampled}
        if stats is not None:
            row.update(prefill_tokens=stats.prefill_tokens, reused_tokens=stats.reused_tokens,
                       copied_tokens=stats.copied_tokens, decode_steps=stats.decode_steps,
                       compact_steps=stats.compact_steps, compact_graph_steps=stats.compact_graph_steps,
                       capture_s=round(stats.capture_s, 3))
            stats.prefill_tokens = stats.reused_tokens = stats.copied_tokens = stats.decode_steps = 0
            stats.compact_steps = stats.compact_graph_steps = 0
            stats.capture_s = 0.0
        if self.phases is not None:
            row.update(self.phases.take())
        self.seconds, self.calls, self.sequences, self.sampled = 0.0, 0, 0, 0
        return row


def profiled(trainer, what: str, step: int) -> None:
    """One more rollout (gen), PPO step (step) or PPO step whose rollout runs unprofiled (train: the training
    passes alone, without the ~300k events of the decode loop) under torch's profiler; prints its operator tables."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    if what == "gen":
        with prof:
            trainer.proxy.rollout(val=False)
            sync()
    elif what == "step":
        with prof:
            trainer.train_step(step, PhaseTimer())
            sync()
    else:
        def start_after_gen(phase: str, seconds: float) -> None:
            if phase == "gen":
                sync()
                prof.start()

        trainer.train_step(step, PhaseTimer(report=start_after_gen))
        sync()
        prof.stop()
    averages = prof.key_averages()
    for sort in (("self_cuda_time_total",) if torch.cuda.is_available() else ()) + ("self_cpu_time_total",):
        print(f"profile of one {what} by {sort}\n"
              f"{averages.table(sort_by=sort, row_limit=30, max_name_column_width=80)}", flush=True)


def overrides(args, out_dir: Path) -> list[str]:
    preset = [] if args.smoke else ["model=smollm2-135m"]
    return [*preset, f"model_path={args.model_path}", "ctx_manager.mode=base",
            f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=False",
            f"trainer.default_local_dir={out_dir}", "trainer.logger=[]", f"es_manager.val.group_size={args.val_samples}", "trainer.validation_steps=1",
            *(["trainer.device=cpu", "es_manager.train.env_groups=4", "es_manager.train.group_size=2",
               "es_manager.train.env_configs.n_groups=[4]", "es_manager.val.env_groups=2",
               "es_manager.val.env_configs.n_groups=[2]", "ppo_mini_batch_size=2", "agent_proxy.max_turn=2",
               "actor_rollout_ref.rollout.response_length=16", "generator.decoder=static"]
              if args.smoke else []),
            *args.override]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="smollm2-135m", help="SFT checkpoint directory or smollm2-135m")
    parser.add_argument("--steps", type=int, default=4, help="PPO steps (the first is not steady state)")
    parser.add_argument("--val-samples", type=int, default=4, help="samples per validation puzzle (128 puzzles)")
    parser.add_argument("--no-val", action="store_true", help="skip the timed validation")
    parser.add_argument("--profile", choices=("gen", "step", "train"),
                        help="after the timed steps, one more rollout (gen), PPO step (step) or PPO step profiled "
                             "from the end of its rollout (train: the training passes alone) under torch's profiler: "
                             "its operator tables by own GPU time and by own CPU time (the footers' totals tell how "
                             "long the GPU sat idle)")
    parser.add_argument("--json", type=Path, help="also write every line to this file (a JSON list)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, tiny batch (CI)")
    parser.add_argument("--config", default="_2_sokoban", help="entry config, e.g. _3_frozen_lake (FrozenLake 4x4)")
    parser.add_argument("override", nargs="*", help="more config overrides (KEY=VALUE), applied last")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not steady state)")
    if args.smoke:
        args.model_path = "tiny"
    elif not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device: run with --smoke on CPU")
    lines: list[dict] = []

    def emit(row: dict) -> None:
        lines.append(row)
        print(json.dumps(row), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(args.config, overrides(args, Path(tmp) / "run"))
        train_env, val_env = cfg.es_manager.train.env_configs.tags[0], cfg.es_manager.val.env_configs.tags[0]
        lock = DirLock(Path(cfg.trainer.default_local_dir))
        start = time.perf_counter()
        trainer = build_trainer(cfg, lock)
        emit({"metric": "build_s", "seconds": round(time.perf_counter() - start, 2)})
        timed = TimedGenerator(trainer.backend)
        trainer.proxy.generator = timed
        steps = []
        for step in range(1, args.steps + 1):
            timer = PhaseTimer()
            with timer("step"):
                metrics = trainer.train_step(step, timer)
            sync()
            row = {"metric": "step", "step": step, **{k: round(v, 3) for k, v in timer.metrics().items()},
                   **timed.take(), "train_tokens": metrics.get("perf/total_num_tokens"),
                   "response_length_mean": metrics.get("response_length/mean"),
                   "success": metrics.get(f"train/{train_env}/success")}
            steps.append(row)
            emit(row)
        if not args.no_val:
            start = time.perf_counter()
            val = trainer.validate()
            sync()
            emit({"metric": "validation", "episodes": 128 * args.val_samples if not args.smoke else None,
                  "seconds": round(time.perf_counter() - start, 3), **timed.take(),
                  "success": val.get(f"val-env/{val_env}/success")})
        if args.profile:
            profiled(trainer, args.profile, args.steps + 1)
            timed.take()
        lock.release()
    steady = steps[1:]
    phases = sorted({k for row in steady for k in row if k.startswith("timing_s/")} - {"timing_s/step"})
    medians = {k: round(statistics.median(row.get(k, 0.0) for row in steady), 3) for k in phases}
    summary = {"metric": "summary", "steady_steps": len(steady), **medians,
               "total": round(statistics.median(row["timing_s/step"] for row in steady), 3),
               **{k: statistics.median(row[k] for row in steady) for k in ("gen_model_s", "prefill_s", "decode_s",
                                                                           "decode_steps", "compact_steps",
                                                                           "sampled_tokens", "prefill_tokens",
                                                                           "reused_tokens", "copied_tokens")
                  if k in steady[0]},
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "commit": _commit(), "overrides": args.override}
    emit(summary)
    if args.json:
        args.json.write_text(json.dumps(lines, indent=1) + "\n")


def _commit() -> str | None:
    """The checkout's commit; $SPA_COMMIT where the copy has no git history (a GPU host)."""
    if os.environ.get("SPA_COMMIT"):
        return os.environ["SPA_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()

"""Evaluate a model on the validation puzzles (spec §11): Pass@1, the original any-of-n metric, the unbiased
pass@k with bootstrap 95% intervals, action statistics, response length and (add_worldmodel) world-model accuracy.
The command line is `python -m SPA_agent.evaluate` (SPA_agent/evaluate.py).

Writes eval.json (numbers + composed config), trajectories.jsonl and passk.png under evaluation.output_dir.
If generation fails mid-run (e.g. an API outage after retries), everything finished so far is written with
`"complete": false` and the reason, and the command exits with status 1; once every request of one turn has
failed (an endpoint that is down or unreachable), the evaluation stops there and `error` names the cause.
"""

from __future__ import annotations

import inspect
import json
import re
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from SPA_agent.entry import (
    check_choice,
    check_list,
    check_number,
    load_tokenizer,
    model_load_errors,
    prepare_config,
)
from SPA_agent.evaluation.passk import pass_any, passk_summary
from SPA_agent.generators import ACTION_SOURCES, check_env_types
from SPA_agent.generators.base import FINISH_ERROR, Generation, Prompt
from SPA_agent.rollout.parsing import MODES as PROMPT_MODES
from SPA_agent.rollout.turns import EnvRecord, rendered_states, turns
from SPA_agent.runs import atomic_io
from SPA_agent.runs.dir_lock import DirLock, check_unlocked, check_writable
from SPA_agent.selfplay.worldmodel import worldmodel_accuracy

ENV_METRICS = ("num_actions", "action_is_valid", "action_is_effective")


def model_name(cfg: Mapping) -> str:
    """Short name for output paths: the API model, `<run>-global_step_N` for PPO actors, the generator's name for
    generators that choose actions without the model (`random`, `solver`), else the last path part."""
    if ACTION_SOURCES.get(cfg["generator"]["name"], "model") != "model":
        name = str(cfg["generator"]["name"])
    elif cfg["generator"]["name"] == "api":
        name = str(cfg["generator"]["model"])
    else:
        path = Path(str(cfg["model_path"]))
        parts = [p for p in path.parts if p not in ("actor", "huggingface")]
        name = f"{parts[-2]}-{parts[-1]}" if parts and parts[-1].startswith("global_step_") and len(parts) > 1 \
            else path.name
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name)


def prepare_eval_config(cfg: DictConfig, config_name: str | None = None) -> DictConfig:
    """Entry config + `evaluation` block; checks n and k and sizes the validation env groups."""
    cfg = prepare_config(cfg, "evaluation", config_name)
    ev = cfg.evaluation
    check_number(cfg, "evaluation.n", 1, integer=True)
    check_number(cfg, "evaluation.repeats", 1, integer=True)
    if ev.k is None:
        ev.k = default_ks(ev.n)
    ks = check_list(cfg, "evaluation.k")
    if not ks or any(not 1 <= k <= ev.n for k in ks):
        raise ValueError(f"evaluation.k={ks} must lie in [1, evaluation.n={ev.n}]: raise n or drop the larger k")
    val = cfg.es_manager.val
    if ev.num_puzzles is not None:
        check_number(cfg, "evaluation.num_puzzles", 1, integer=True)
    num_puzzles = int(ev.num_puzzles or val.env_groups)
    tags = list(val.env_configs.tags)
    if num_puzzles != val.env_groups:
        if len(tags) != 1:
            raise ValueError("evaluation.num_puzzles with several val tags: set es_manager.val.env_configs.n_groups")
        val.env_configs.n_groups = [num_puzzles]
    val.env_groups, val.group_size = num_puzzles, int(ev.n)
    check_choice(cfg, "evaluation.prompt_mode", PROMPT_MODES)
    cfg.ctx_manager.mode = ev.prompt_mode  # the one road: the context manager reads ctx_manager.mode
    check_env_types(cfg.generator, {cfg.custom_envs[tag].env_type for tag in tags})
    with open_dict(cfg):
        cfg.model_name = model_name(cfg)
    return cfg


def default_ks(n: int) -> list[int]:
    """The k of pass@k when evaluation.k is not set: the powers of two below n, and n (n=8: [1, 2, 4, 8])."""
    return [2**i for i in range(n.bit_length()) if 2**i < n] + [n]


class ErrorTolerantGenerator:
    """Wraps a generator so failed requests come back as `finish_reason="error"` (when the generator supports
    `allow_failures`) and records, per generate call, the positions of the failed prompts. Once every request
    of a call has failed, the endpoint counts as down (`down` holds the cause): later calls fail at once, without
    requests, so the rollout ends quickly and the evaluation stops with that cause."""

    def __init__(self, generator):
        self.generator = generator
        self.needs_env = bool(getattr(generator, "needs_env", False))  # the solver plans on a copy of the env
        self.tolerant = "allow_failures" in inspect.signature(generator.generate).parameters
        self.failed_positions: list[list[int]] = []
        self.down: str | None = None

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        if self.down is not None:
            generations = [Generation("", None, FINISH_ERROR) for _ in prompts]
        else:
            kwargs = {"allow_failures": True} if self.tolerant else {}
            generations = self.generator.generate(prompts, **kwargs)
            if generations and all(g.finish_reason == FINISH_ERROR for g in generations):
                self.down = getattr(self.generator, "last_error", None) or "the generator gave no reason"
        self.failed_positions.append([i for i, g in enumerate(generations) if g.finish_reason == FINISH_ERROR])
        return generations

    def failed_env_ids(self, states: list[EnvRecord], first_call: int) -> set[int]:
        """Env ids with a failed request among the calls since `first_call`. Call t prompts the envs that took
        a turn t, in env-id order (the proxy steps the active envs in order)."""
        failed = set()
        for turn, positions in enumerate(self.failed_positions[first_call:]):
            active = sorted(s.env_id for s in states if len(turns(s.history)) > turn)
            failed.update(active[p] for p in positions)
        return failed


def trajectory_record(proxy, state: EnvRecord, repeat: int, failed: bool) -> dict:
    """What trajectories.jsonl stores for one episode."""
    taken = turns(state.history)
    return {
        "repeat": repeat, "env_id": state.env_id, "group_id": state.group_id, "tag": state.tag,
        "seed": int(state.seed), "success": state.metrics[f"{state.tag}/success"] > 0,
        "failed_request": failed, "messages": proxy.messages(state, normalized=False),
        "actions": [turn.actions for turn in taken],
        "rewards": [turn.reward for turn in taken],
        "true_states": rendered_states(state.history),
        "response_tokens": sum(len(turn.response_ids or []) for turn in taken),
        "metrics": state.metrics,
    }


def tag_metrics(records: list[dict], ks: list[int], cfg: DictConfig) -> dict[str, float]:
    """Metrics of one env tag from its trajectory records (failed requests excluded)."""
    ev = cfg.evaluation
    by_puzzle: dict[int, list[bool]] = defaultdict(list)
    by_repeat: dict[tuple[int, int], list[bool]] = defaultdict(list)
    for r in records:
        by_puzzle[r["seed"]].append(r["success"])
        by_repeat[(r["repeat"], r["seed"])].append(r["success"])
    counts = [(len(v), sum(v)) for _, v in sorted(by_puzzle.items())]
    usable = [k for k in ks if k <= min(n for n, _ in counts)]
    metrics = passk_summary(counts, usable, num_resamples=ev.bootstrap_resamples, seed=ev.bootstrap_seed)
    metrics = {key: value for key, value in metrics.items() if not key.startswith("pass_any")}
    metrics["success"] = sum(r["success"] for r in records) / len(records)
    metrics[f"pass_any@{ev.n}"] = sum(pass_any(len(v), sum(v)) for v in by_repeat.values()) / len(by_repeat)
    tag = records[0]["tag"]
    for name in ENV_METRICS:  # absent when no action ran in the episode: counts as 0 (spec §5.5)
        metrics[name] = sum(r["metrics"].get(f"{tag}/{name}", 0.0) for r in records) / len(records)
    metrics["response_length"] = sum(r["response_tokens"] for r in records) / len(records)
    return metrics


def summarize(cfg: DictConfig, records: list[dict], states: list[EnvRecord], error: str | None) -> dict:
    """eval.json contents: metrics per tag (+ world-model accuracy), per-puzzle counts, status and config."""
    ev = cfg.evaluation
    usable = [r for r in records if not r["failed_request"]]
    per_tag: dict[str, list[dict]] = defaultdict(list)
    for r in usable:
        per_tag[r["tag"]].append(r)
    metrics = {tag: tag_metrics(rs, list(ev.k), cfg) for tag, rs in sorted(per_tag.items())}
    if ev.prompt_mode == "add_worldmodel":
        for key, value in worldmodel_accuracy(states).items():
            tag, name = key.split("/", 1)
            metrics.setdefault(tag, {})[name] = value
    per_puzzle = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in usable:
        per_puzzle[r["tag"]][r["seed"]][0] += 1
        per_puzzle[r["tag"]][r["seed"]][1] += int(r["success"])
    return {
        "complete": error is None and len(usable) == len(records) and bool(records),
        "error": error, "num_failed_trajectories": len(records) - len(usable),
        "num_trajectories": len(records), "config_name": cfg.config_name, "model_path": str(cfg.model_path),
        "model_name": cfg.model_name, "generator": cfg.generator.name, "prompt_mode": ev.prompt_mode,
        "n": ev.n, "k": list(ev.k), "repeats": ev.repeats, "num_puzzles": cfg.es_manager.val.env_groups,
        "metrics": metrics,
        "per_puzzle": {tag: [{"seed": s, "n": n, "c": c} for s, (n, c) in sorted(p.items())]
                       for tag, p in per_puzzle.items()},
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def run_repeats(cfg: DictConfig, proxy, generator: ErrorTolerantGenerator) -> tuple[list, list, str | None]:
    """Trajectory records and states of every finished repeat; stops at the first generation error."""
    records, states, error = [], [], None
    for repeat in range(cfg.evaluation.repeats):
        first_call = len(generator.failed_positions)
        try:
            rollout = proxy.rollout(val=True)
        except Exception as err:  # noqa: BLE001 — any backend failure: keep what is done, report the reason
            error = f"repeat {repeat}: {type(err).__name__}: {err}"
            break
        failed = generator.failed_env_ids(rollout.states, first_call)
        records += [trajectory_record(proxy, s, repeat, s.env_id in failed) for s in rollout.states]
        states += rollout.states
        if generator.down is not None:
            error = f"repeat {repeat}: every request of a turn failed: {generator.down}"
            break
    return records, states, error


def check_replaceable(out_dir: Path, cfg: DictConfig) -> None:
    """Refuse, before any model is loaded, to replace the evaluation of another model in `out_dir` (its eval.json
    names another model_path or model name) unless `evaluation.overwrite`; a rerun for the same model, or over a
    damaged eval.json, replaces it."""
    path = out_dir / "eval.json"
    if cfg.evaluation.overwrite or not path.is_file():
        return
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
        model_path = previous.get("model_path") or previous["config"]["model_path"]
        name = previous.get("model_name") or previous["config"].get("model_name", model_name(previous["config"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return
    if (str(model_path), name) != (str(cfg.model_path), cfg.model_name):
        raise ValueError(f"{out_dir} holds the evaluation of another model ({name}: {model_path}); pass "
                         "evaluation.overwrite=true to replace it, or choose another evaluation.output_dir")


def evaluate(cfg: DictConfig, generator=None) -> dict:
    """Run the evaluation for a prepared config (`prepare_eval_config`) and write its outputs. `generator`
    (optional) is an already-built generator, e.g. the PPO actor's; otherwise `cfg.generator` is built."""
    from SPA_agent.evaluation.plots import plot_passk
    from SPA_agent.generators import build_generator
    from SPA_agent.rollout.agent_proxy import LLMAgentProxy

    ev, out_dir = cfg.evaluation, Path(cfg.evaluation.output_dir)
    check_writable(out_dir)
    check_unlocked(out_dir)
    check_replaceable(out_dir, cfg)
    tokenizer = load_tokenizer(cfg.model_path)
    if generator is None:
        with model_load_errors(cfg.model_path):
            generator = build_generator(cfg.generator, cfg.model_path, tokenizer)
    generator = ErrorTolerantGenerator(generator)
    proxy = LLMAgentProxy(cfg, generator, tokenizer, progress=True)
    with DirLock(out_dir):  # also fails early on an unwritable directory, before any rollout
        records, states, error = run_repeats(cfg, proxy, generator)
        if ev.write_trajectories:
            atomic_io.write_jsonl(out_dir / "trajectories.jsonl", records)
        result = summarize(cfg, records, states, error) if records else {"complete": False, "error": error,
                                                                            "config": OmegaConf.to_container(cfg)}
        atomic_io.write_json(out_dir / "eval.json", result)
        if ev.write_plots and result.get("metrics"):
            plot_passk(result, out_dir / "passk.png")
    return result


def format_result(result: Mapping) -> str:
    """One line per tag with the headline numbers."""
    lines = [] if result["complete"] else [f"INCOMPLETE: {result.get('error') or 'failed requests excluded'}"]
    for tag, m in result.get("metrics", {}).items():
        passk = ", ".join(f"{k}={m[k]:.3f} [{m[k + '_ci_low']:.3f}, {m[k + '_ci_high']:.3f}]"
                          for k in m if re.fullmatch(r"pass@\d+", k))
        lines.append(f"{tag}: success={m.get('success', float('nan')):.3f} {passk} "
                     f"pass_any@{result['n']}={m.get('pass_any@' + str(result['n']), float('nan')):.3f}")
    return "\n".join(lines)

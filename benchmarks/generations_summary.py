"""What a policy writes, validation by validation: a run's val_generations.jsonl summarized (issue 43).

    python benchmarks/generations_summary.py <run_dir> [--top 3]
    python benchmarks/generations_summary.py <eval_out>/trajectories.jsonl --mode add_worldmodel

The metrics say how often a model succeeds and how long it writes; `trainer.log_val_generations=N` keeps the text
(SPA_agent/trainer/generations_log.py). This reads it back, as a markdown table with one line per validation step:
the trajectories logged, their success, their assistant turns, the share of those turns that are well formed (the
parser training scores them with, `SPA_agent.rollout.parsing.parse_response`, in the run's prompt mode), the mean
characters a turn, and the --top most common think texts (a well-formed turn's think, whitespace collapsed, cut at
60 characters; a malformed turn counts as "(malformed: <where it leaves the format>)", e.g. "text between </think>
and <answer>") with how many turns wrote each. The 300-step study read in it that its world-model SFT's policy thinks
the prompt's placeholder, `[Your thoughts]`, in base prompts, and that two of its seeds never found the base format
because they wrote a sentence between the think and the answer.

The prompt mode and the parser's settings come from `config.yaml` beside the file (every PPO run writes one), or
from --mode; an evaluation's trajectories.jsonl (the same records without a step) is one line, step "-". Reads the
gzip-compressed `.jsonl.gz` that docs/results keeps as the plain file.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from omegaconf import OmegaConf

from SPA_agent.rollout.parsing import MODES, THINK_END, WORLDMODEL_START, WORLDMODEL_THINK_END, parse_response
from SPA_agent.runs.metrics_file import jsonl_in, read_records
from SPA_agent.trainer.generations_log import GENERATIONS_FILE

THINK_CHARS = 60


def generations_file(path: Path) -> Path:
    """`path` itself, or the val_generations.jsonl[.gz] of a run directory; FileNotFoundError if there is none."""
    if not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        return path
    found = jsonl_in(path, GENERATIONS_FILE)
    if found is None:
        raise FileNotFoundError(f"{path}: no {GENERATIONS_FILE} or {GENERATIONS_FILE}.gz")
    return found


def parser_settings(path: Path, mode: str | None) -> dict:
    """parse_response's keywords: the run's config.yaml beside `path` where there is one, --mode over its mode."""
    settings = {"mode": "base", "action_sep": "||", "max_actions": 5, "enable_think": True}
    config = path.parent / "config.yaml"
    if config.is_file():
        cfg = OmegaConf.load(config)
        settings.update(mode=OmegaConf.select(cfg, "ctx_manager.mode", default="base"),
                        action_sep=OmegaConf.select(cfg, "agent_proxy.action_sep", default="||"),
                        max_actions=OmegaConf.select(cfg, "agent_proxy.max_actions_per_turn", default=5),
                        enable_think=OmegaConf.select(cfg, "agent_proxy.enable_think", default=True))
    if mode is not None:
        settings["mode"] = mode
    return settings


def malformed_because(text: str, mode: str, enable_think: bool = True) -> str:
    """Where a turn that `parse_response` finds malformed leaves its format: the first of the format's separators
    (SPA_agent/rollout/parsing.py's, searched as it searches them) that the text lacks."""
    if mode == "add_worldmodel":
        start = WORLDMODEL_START.search(text)
        if start is None:
            return "no <observation> opening the think"
        observation_end = text.find("</observation>", start.end())
        if observation_end < 0:
            return "no </observation>"
        prediction = text.find("<prediction>", observation_end)
        if prediction < 0:
            return "no <prediction>"
        return "no </answer>" if WORLDMODEL_THINK_END.search(text, prediction) else "no </prediction></think><answer>"
    if not enable_think:
        return "no </answer>" if "<answer>" in text else "no <answer>"
    start = text.find("<think>")
    if start < 0:
        return "no <think>"
    if THINK_END.search(text, start):
        return "no </answer>"
    think_end = text.find("</think>", start)
    if think_end < 0:
        return "no </think>"
    return "text between </think> and <answer>" if "<answer>" in text[think_end:] else "no <answer> after </think>"


def think_text(parsed, settings: dict) -> str:
    if not parsed.format_ok:
        return f"(malformed: {malformed_because(parsed.raw, settings['mode'], settings['enable_think'])})"
    think = " ".join(parsed.think.split())
    return think if len(think) <= THINK_CHARS else think[:THINK_CHARS] + "…"


def summary(records: list[dict], settings: dict, top: int) -> str:
    by_step: dict[object, list[dict]] = {}
    for record in records:
        by_step.setdefault(record.get("step", "-"), []).append(record)
    lines = ["| step | trajectories | success | turns | well-formed turns | characters a turn | most common thinks "
             "(turns) |", "|---|---|---|---|---|---|---|"]
    for step, group in by_step.items():
        responses = [m["content"] for r in group for m in r["messages"] if m["role"] == "assistant"]
        parsed = [parse_response(text, **settings) for text in responses]
        thinks = Counter(think_text(p, settings) for p in parsed).most_common(top)
        shown = "; ".join(f"`{text}` {count}" for text, count in thinks)
        turns = max(len(responses), 1)
        lines.append(f"| {step} | {len(group)} | {sum(r['success'] for r in group) / len(group):.3f} | "
                     f"{len(responses)} | {sum(p.format_ok for p in parsed) / turns:.3f} | "
                     f"{sum(map(len, responses)) / turns:.0f} | {shown} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a run directory, or a val_generations.jsonl[.gz] or "
                                                "trajectories.jsonl file")
    parser.add_argument("--mode", choices=MODES, help="the prompt mode to parse in (default: the run's "
                                                      "config.yaml, else base)")
    parser.add_argument("--top", type=int, default=3, help="think texts shown a step (default 3)")
    args = parser.parse_args()
    try:
        path = generations_file(args.path)
    except FileNotFoundError as error:
        parser.exit(2, f"error: {error}\n")
    try:
        records, _ = read_records(path)  # a cut-short last line (a run stopped mid-write) dropped
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    if not records:
        parser.exit(2, f"error: {path}: no records\n")
    print(summary(records, parser_settings(path, args.mode), args.top))


if __name__ == "__main__":
    main()

"""Markdown table of our results, one row per run and env tag, beside the paper's reference numbers. The command
line; the report itself is SPA_agent/evaluation/report.py.

    python -m SPA_agent.report evals/_2_sokoban-tiny checkpoints/_2_sokoban/sokoban-main [--out report.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from SPA_agent.evaluation.paper_results import MAIN_RESULTS, MODEL_SIZE_TO_PAPER
from SPA_agent.evaluation.report import build_report
from SPA_agent.runs import atomic_io


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Markdown table of our runs beside the paper's numbers.")
    parser.add_argument("runs", nargs="+", type=Path, help="evaluation or PPO run directories")
    parser.add_argument("--paper-model", action="append", default=None,
                        help=f"paper model rows to show (repeatable; default Qwen2.5-1.5B-Instruct). "
                             f"One of: {', '.join(MAIN_RESULTS)}; model_size aliases: {MODEL_SIZE_TO_PAPER}")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    try:
        models = [MODEL_SIZE_TO_PAPER.get(m, m) for m in args.paper_model] if args.paper_model else None
        report = build_report(args.runs, models)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out:
        try:
            atomic_io.write_text(args.out, report)
        except OSError as err:
            print(f"error: cannot write {args.out}: {err.strerror or err}; choose a writable --out", file=sys.stderr)
            return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

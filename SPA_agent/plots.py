"""PNG plots of an evaluation or a PPO run. The command line; the plots themselves are
SPA_agent/evaluation/plots.py.

    python -m SPA_agent.plots <run dir or eval dir> [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from SPA_agent.evaluation.plots import plot_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Plot pass@k (eval dir), validation curves and diagnostics (PPO run dir).")
    parser.add_argument("run_dir", type=Path, help="an evaluation directory or a PPO run directory")
    parser.add_argument("--out", type=Path, default=None, help="directory for the PNGs (default: run_dir)")
    args = parser.parse_args(argv)
    try:
        for path in plot_dir(args.run_dir, args.out):
            print(path)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data-side ablations of stage 1: which states are written into the model's `<observation>`/`<prediction>`.

- `ground_truth` (SPA, spec §8): the environment's renders, coordinate sentence included.
- `self_belief` (paper Table 3): no substitution; the model's own imagined states are kept and trained on.
- `random_coordinates` (paper §4.2, Fig. 5): the true renders with every (row,col) pair of the coordinate
  sentence replaced by an i.i.d. uniform cell of the same grid; the symbol grid itself stays true.

Only the assistant's state blocks change; the `State:` renders in the user turns stay the true ones.
"""

from __future__ import annotations

import re

import numpy as np

from SPA_agent.worldmodel import SUDOKU_ROW_MARK

STATE_TARGETS = ("ground_truth", "self_belief", "random_coordinates")
COORDINATE_PAIR_RE = re.compile(r"\((\d+),(\d+)\)")


def _grid_and_rest(state: str) -> tuple[list[str], list[str], int]:
    """(grid lines, coordinate lines, index base) of a render: Sudoku boards are one `|` line with 1-indexed
    coordinates; symbol grids are the leading lines without a space, 0-indexed."""
    lines = state.split("\n")
    if lines and lines[0].startswith(SUDOKU_ROW_MARK):
        return lines[:1], lines[1:], 1
    num_grid = next((i for i, line in enumerate(lines) if " " in line or not line), len(lines))
    return lines[:num_grid], lines[num_grid:], 0


def randomize_coordinates(state: str, rng: np.random.Generator) -> str:
    """`state` with each (row,col) pair after the grid replaced by a uniformly random cell of that grid
    (independently per pair, same index base as the render); a render without coordinates is unchanged."""
    grid, rest, base = _grid_and_rest(state)
    if base == 1:
        rows = [r for r in grid[0].split(SUDOKU_ROW_MARK) if r.strip()]
        num_rows, num_cols = len(rows), len(rows[0].split()) if rows else 0
    else:
        num_rows, num_cols = len(grid), max((len(line) for line in grid), default=0)
    if not rest or num_rows == 0 or num_cols == 0:
        return state

    def draw(_: re.Match) -> str:
        return f"({base + int(rng.integers(num_rows))},{base + int(rng.integers(num_cols))})"

    return "\n".join(grid + [COORDINATE_PAIR_RE.sub(draw, line) for line in rest])


def state_targets(true_states: list[str], target: str, rng: np.random.Generator) -> list[str] | None:
    """The states to write into a trajectory's blocks for `data_gen.state_targets`; None = no substitution."""
    if target == "ground_truth":
        return true_states
    if target == "self_belief":
        return None
    if target == "random_coordinates":
        return [randomize_coordinates(state, rng) for state in true_states]
    raise ValueError(f"data_gen.state_targets must be one of {STATE_TARGETS}, got {target!r}")

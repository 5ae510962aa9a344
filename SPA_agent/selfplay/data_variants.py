"""Data-side ablations of stage 1: which states are written into the model's `<observation>`/`<prediction>`.

- `ground_truth` (SPA, spec §8): the environment's renders, coordinate sentence included.
- `self_belief` (paper Table 3): no substitution; the model's own imagined states are kept and trained on.
- `random_coordinates` (paper §4.2, Fig. 5): the true renders with every (row,col) pair of the coordinate
  sentence replaced by an i.i.d. uniform cell of the same grid; the symbol grid itself stays true.

Only the assistant's state blocks change; the `State:` renders in the user turns stay the true ones.

One variant changes the format instead: `without_worldmodel_row` turns a world-model row into the plain base-format
row of the same turn (no `<observation>`/`<prediction>`, base instruction and format sentence): the "no world
model" control of issue 13, trained on the same trajectories as SPA.
"""

from __future__ import annotations

import re

import numpy as np

from SPA_agent.rollout.parsing import BASE_FORMAT, WORLDMODEL_FORMAT, find_worldmodel_blocks, strip_tags
from SPA_agent.selfplay.worldmodel import OBSERVATION_TAGS, PREDICTION_TAGS, SUDOKU_ROW_MARK, block_contents

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


def _drop_blocks(text: str, tags: tuple[str, str]) -> str:
    """`text` without its `open…close` blocks (tags and contents)."""
    pieces, pos = [], 0
    for start, end in block_contents(text, tags):
        pieces.append(text[pos:start - len(tags[0])])
        pos = end + len(tags[1])
    return "".join(pieces) + text[pos:]


def strip_worldmodel(response: str) -> str:
    """A world-model response as the base format writes the same turn: `<think>{thoughts}</think><answer>{answer}
    </answer>` (normalized as base-mode parsing normalizes, parsing.parse_response), where the thoughts are those
    between `</observation>` and `<prediction>`. A response not in the world-model format only loses its state
    blocks (tags and contents)."""
    blocks = find_worldmodel_blocks(response)
    if blocks is None:
        return _drop_blocks(_drop_blocks(response, OBSERVATION_TAGS), PREDICTION_TAGS)
    _, thoughts, _, answer = blocks
    return f"<think>{strip_tags(thoughts)}</think><answer>{strip_tags(answer)}</answer>"


def without_worldmodel_row(prompt: list[dict], response: str, worldmodel_instruction: str,
                           base_instruction: str) -> tuple[list[dict], str]:
    """(prompt, response) of a world-model SFT row as the base prompt mode shows the same turn: the first user
    message's instruction is the base one (`env_instruction` instead of `env_instruction_add_worldmodel`; what
    follows it, symbols and actions, is the same in both modes), every format sentence is the base one, and
    every assistant message and the response go through `strip_worldmodel`."""
    messages = [dict(message) for message in prompt]
    first_user = next((m for m in messages if m["role"] == "user"), None)
    if first_user is None or not first_user["content"].startswith(worldmodel_instruction):
        raise ValueError("the row's first user message does not start with the add_worldmodel instruction: "
                         "is it world-model SFT data of this env?")
    first_user["content"] = base_instruction + first_user["content"][len(worldmodel_instruction):]
    for message in messages:
        if message["role"] == "user":
            message["content"] = message["content"].replace(WORLDMODEL_FORMAT, BASE_FORMAT)
        elif message["role"] == "assistant":
            message["content"] = strip_worldmodel(message["content"])
    return messages, strip_worldmodel(response)

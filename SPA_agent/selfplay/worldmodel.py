"""World-model text utilities: read, replace and score the `<observation>`/`<prediction>` states of a response.

In `add_worldmodel` mode the model writes its belief about the current state inside `<observation>…</observation>`
and about the state after its actions inside `<prediction>…</prediction>` (spec §6.4). These pure functions

- extract those contents (`extract_states`) and check a response's world-model format (`has_worldmodel_format`,
  the data filter's test, spec §8),
- overwrite them with the environment's true renders (`substitute_states`, spec §8 step 4 — inserted as plain
  text, so states containing backslashes are copied verbatim), and
- score imagined states against true ones (`state_accuracy`, `worldmodel_accuracy`): exact match, per-cell
  accuracy of the grid (Sokoban/FrozenLake rows) or board (Sudoku digits), and exact match of the coordinate
  sentence that `text_with_coordinates` renders add.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from SPA_agent.rollout.turns import EnvRecord, transitions

OBSERVATION_TAGS = ("<observation>", "</observation>")
PREDICTION_TAGS = ("<prediction>", "</prediction>")
SUDOKU_ROW_MARK = "|"
_FLAGS = re.IGNORECASE | re.DOTALL
THINK_RE = re.compile(r"<think>(.*?)</think>", _FLAGS)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", _FLAGS)
OBSERVATION_RE = re.compile(r"<observation>.*?</observation>", _FLAGS)
PREDICTION_RE = re.compile(r"<prediction>.*?</prediction>", _FLAGS)

# Names of the accuracy metrics, in the order they are reported.
ACCURACY_KEYS = (
    "observation_exact", "observation_cell", "observation_coords",
    "prediction_exact", "prediction_cell", "prediction_coords",
)


def block_contents(text: str, tags: tuple[str, str]) -> list[tuple[int, int]]:
    """[start, end) ranges of the contents of the `open…close` blocks of `text`, left to right: the matches
    of `re.finditer("open(.*?)close")`, found in linear time (that regex rescans the rest of the text from
    every opening tag that is never closed, so a long response full of them takes seconds)."""
    opening, closing = tags
    ranges, pos = [], 0
    while (start := text.find(opening, pos)) >= 0:
        start += len(opening)
        end = text.find(closing, start)
        if end < 0:
            break
        ranges.append((start, end))
        pos = end + len(closing)
    return ranges


def _replace_contents(text: str, tags: tuple[str, str], content: str) -> tuple[str, int]:
    """`text` with the contents of its `tags` blocks replaced by `content`, and the number of blocks."""
    ranges = block_contents(text, tags)
    pieces, pos = [], 0
    for start, end in ranges:
        pieces += [text[pos:start], content]
        pos = end
    return "".join(pieces) + text[pos:], len(ranges)


def extract_states(response: str) -> tuple[list[str], list[str]]:
    """Contents of every `<observation>` and every `<prediction>` block of `response`, in order, unstripped."""
    contents = lambda tags: [response[start:end] for start, end in block_contents(response, tags)]
    return contents(OBSERVATION_TAGS), contents(PREDICTION_TAGS)


def has_worldmodel_format(response: str) -> bool:
    """True if the first think block starts before the first answer block and its body holds an observation
    block whose start precedes the first prediction block's start."""
    think, answer = THINK_RE.search(response), ANSWER_RE.search(response)
    if think is None or answer is None or think.start() >= answer.start():
        return False
    body = think.group(1)
    observation, prediction = OBSERVATION_RE.search(body), PREDICTION_RE.search(body)
    return observation is not None and prediction is not None and observation.start() < prediction.start()


@dataclass(frozen=True)
class Substitution:
    """Result of `substitute_states`: the new text and how many blocks of each kind were overwritten."""

    text: str
    num_observations: int
    num_predictions: int

    @property
    def has_states(self) -> bool:
        """True when the response had at least one state block (it is then in the world-model format)."""
        return self.num_observations + self.num_predictions > 0


def substitute_states(response: str, observation: str, prediction: str) -> Substitution:
    """Overwrite the content of every `<observation>` block with `observation` and of every `<prediction>`
    block with `prediction` (tags kept). The states are inserted literally, whatever characters they hold."""
    obs_text, num_obs = _replace_contents(response, OBSERVATION_TAGS, observation)
    text, num_pred = _replace_contents(obs_text, PREDICTION_TAGS, prediction)
    return Substitution(text=text, num_observations=num_obs, num_predictions=num_pred)


@dataclass(frozen=True)
class ParsedState:
    """A state render split into its cells and its coordinate sentence.

    cells: rows of cells — characters of each grid row, or the digits/dots of each Sudoku row.
    coords: the coordinate sentence(s) after the grid, whitespace-normalized ("" for plain `text` renders).
    """

    cells: tuple[tuple[str, ...], ...]
    coords: str


def _normalize_line(line: str) -> str:
    return " ".join(line.split())


def parse_state(text: str) -> ParsedState:
    """Split a rendered state (or a model's imagined one) into cells and coordinate text.

    Grid renders (Sokoban, FrozenLake): every leading line without a space is a grid row, one cell per
    character. Sudoku renders: a first line starting with `|` holds the board, `| 3 2 4 1 | . 4 . . | …`,
    split into rows at `|`. The remaining lines form the coordinate text.
    """
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if lines and lines[0].startswith(SUDOKU_ROW_MARK):
        rows = [tuple(row.split()) for row in lines[0].split(SUDOKU_ROW_MARK) if row.strip()]
        rest = lines[1:]
    else:
        num_grid = next((i for i, line in enumerate(lines) if " " in line), len(lines))
        rows = [tuple(line) for line in lines[:num_grid]]
        rest = lines[num_grid:]
    return ParsedState(cells=tuple(rows), coords=_normalize_line(" ".join(rest)))


def normalize_state(text: str) -> str:
    """Canonical form used for exact match: blank lines dropped, runs of spaces collapsed, ends stripped."""
    return "\n".join(_normalize_line(line) for line in text.strip().splitlines() if line.strip())


def cell_accuracy(imagined: ParsedState, true: ParsedState) -> float:
    """Fraction of the true state's cells that the imagined state has, position by position (row, column).
    Cells missing from the imagined grid count as wrong; extra imagined cells are ignored."""
    total = sum(len(row) for row in true.cells)
    if total == 0:
        return float(imagined.coords == true.coords)
    hits = 0
    for r, true_row in enumerate(true.cells):
        imagined_row = imagined.cells[r] if r < len(imagined.cells) else ()
        hits += sum(c < len(imagined_row) and imagined_row[c] == cell for c, cell in enumerate(true_row))
    return hits / total


def state_accuracy(imagined: str, true: str) -> dict[str, float | None]:
    """Scores of one imagined state against the true render.

    Returns `exact` (1.0/0.0, after `normalize_state`), `cell` (`cell_accuracy`) and `coords` (1.0/0.0: the
    coordinate sentence matches exactly after whitespace normalization; None when the true render has none).
    """
    imagined_parsed, true_parsed = parse_state(imagined), parse_state(true)
    coords = None if not true_parsed.coords else float(imagined_parsed.coords == true_parsed.coords)
    return {
        "exact": float(normalize_state(imagined) == normalize_state(true)),
        "cell": cell_accuracy(imagined_parsed, true_parsed),
        "coords": coords,
    }


def turn_accuracy(response: str, state_before: str, state_after: str) -> dict[str, float | None] | None:
    """Scores of the first `<observation>` (vs `state_before`) and first `<prediction>` (vs `state_after`) of one
    assistant response, keyed as in `ACCURACY_KEYS`; None when the response has neither block. A missing block
    scores 0 on its keys (coords stay None when the true state has no coordinate sentence)."""
    observations, predictions = extract_states(response)
    if not observations and not predictions:
        return None
    scores: dict[str, float | None] = {}
    for kind, found, true in (("observation", observations, state_before), ("prediction", predictions, state_after)):
        acc = state_accuracy(found[0], true) if found else _zero_accuracy(true)
        for name, value in acc.items():
            scores[f"{kind}_{name}"] = value
    return scores


def _zero_accuracy(true: str) -> dict[str, float | None]:
    return {"exact": 0.0, "cell": 0.0, "coords": None if not parse_state(true).coords else 0.0}


def trajectory_turns(history: Sequence[Mapping]) -> Iterable[tuple[str, str, str]]:
    """(raw response, true state before, true state after) for every turn taken in a rollout-state `history`
    (docs/interfaces.md: `history[t]["state"]` / `history[t+1]["state"]` bracket turn t)."""
    for turn, after in transitions(history):
        yield turn.llm_raw_response, turn.state, after


def worldmodel_accuracy(states: Sequence[EnvRecord], prefix: str = "") -> dict[str, float]:
    """World-model metrics over the rollout states of one rollout (`Rollout.states`), per env tag.

    For each tag: `<prefix><Tag>/worldmodel/<key>` = mean over the turns whose response has a state block
    (coords: over those whose true state has a coordinate sentence), plus `<Tag>/worldmodel/format_rate` =
    fraction of turns with a state block. The PPO trainer calls this during validation in add_worldmodel mode.
    """
    sums: dict[str, dict[str, list[float]]] = {}
    for record in states:
        per_tag = sums.setdefault(record.tag, {key: [] for key in (*ACCURACY_KEYS, "format_rate")})
        for response, before, after in trajectory_turns(record.history):
            scores = turn_accuracy(response, before, after)
            per_tag["format_rate"].append(float(scores is not None))
            for key, value in (scores or {}).items():
                if value is not None:
                    per_tag[key].append(value)
    return {
        f"{prefix}{tag}/worldmodel/{key}": sum(values) / len(values)
        for tag, per_tag in sums.items() for key, values in per_tag.items() if values
    }

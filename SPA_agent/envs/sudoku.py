"""Sudoku 4x4 (spec §3.4): env_type `sudoku`, tag Sudoku.

The solution is a shuffled pattern grid, the puzzle blanks cells while the solution stays unique
(`random.Random(seed)`, so global RNG state is never touched). A move is the string `"r,c,v"`
(1-indexed row and column); `place 3 at row 2 col 1` is understood too. The render mode is a config
field (the original read the `RENDER_MODE` environment variable at render time).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from SPA_agent.envs.base import RENDER_MODES, BaseEnv, check, resolve_seed

BOX = 2
"""Side of a sub-box; the board is BOX**2 cells wide."""
CLUES = {"easy": 10, "medium": 9, "hard": 6}
"""Clue cells kept for each difficulty (4x4 board)."""
EXTRA_PASSES = 8
"""Reshuffled blanking passes tried after the first while the puzzle has more clues than its target."""

Board = list[list[int]]  # 0 = empty


@dataclass
class SudokuEnvConfig:
    """Config of `SudokuEnv` (keys of `custom_envs.<Tag>.env_config`)."""

    board_size: int = 4
    """Rows and columns of the board (only 4 is supported)."""
    max_steps: int = 30
    """The episode ends after this many moves, valid or not."""
    difficulty: str = "easy"
    """`easy` (10 clues), `medium` (9) or `hard` (6)."""
    render_mode: str = "text"
    """`text` (the board) or `text_with_coordinates` (the board and the empty cells, 1-indexed)."""

    action_lookup = None
    """Sudoku takes the raw action string; there is no id table."""

    def __post_init__(self) -> None:
        check(self.board_size == BOX * BOX, self, "board_size", f"only {BOX * BOX} is supported")
        check(
            isinstance(self.max_steps, int) and self.max_steps >= 1,
            self,
            "max_steps",
            "must be an integer >= 1",
        )
        check(self.difficulty in CLUES, self, "difficulty", f"must be one of {sorted(CLUES)}")
        check(self.render_mode in RENDER_MODES, self, "render_mode", f"must be one of {RENDER_MODES}")


def generate_solution(rng: random.Random, size: int = BOX * BOX) -> Board:
    """A full board: the pattern ((r*b + r//b + c) mod N) + 1 with bands, rows in bands, stacks and
    columns in stacks shuffled, then the digits relabelled by a random permutation."""

    def shuffled_lines() -> list[int]:
        bands = list(range(BOX))
        rng.shuffle(bands)
        lines = []
        for band in bands:
            inner = list(range(BOX))
            rng.shuffle(inner)
            lines += [band * BOX + i for i in inner]
        return lines

    rows, cols = shuffled_lines(), shuffled_lines()
    digits = list(range(1, size + 1))
    rng.shuffle(digits)
    pattern = lambda r, c: (r * BOX + r // BOX + c) % size
    return [[digits[pattern(r, c)] for c in cols] for r in rows]


def count_solutions(board: Board, limit: int = 2) -> int:
    """Solutions of `board` (0 = empty), counting stops at `limit`. Backtracks on the empty cell with the
    fewest candidates (row-major tie-break), trying candidates in ascending order."""
    best = None
    for r, row in enumerate(board):
        for c, value in enumerate(row):
            if value == 0:
                options = candidates(board, r, c)
                if best is None or len(options) < len(best[2]):
                    best = (r, c, options)
                if len(options) <= 1:
                    break
        else:
            continue
        break
    if best is None:
        return 1
    r, c, options = best
    total = 0
    for value in options:
        board[r][c] = value
        total += count_solutions(board, limit - total)
        board[r][c] = 0
        if total >= limit:
            break
    return total


def candidates(board: Board, r: int, c: int) -> list[int]:
    """Digits not yet in row r, column c or the sub-box of (r, c)."""
    return [v for v in range(1, len(board) + 1) if not conflicts(board, r, c, v)]


def conflicts(board: Board, r: int, c: int, value: int) -> bool:
    """Whether `value` already appears in row r, column c or the sub-box of (r, c), cell (r, c) excluded."""
    br, bc = r - r % BOX, c - c % BOX
    peers = {(r, j) for j in range(len(board))} | {(i, c) for i in range(len(board))}
    peers |= {(i, j) for i in range(br, br + BOX) for j in range(bc, bc + BOX)}
    return any(board[i][j] == value for i, j in peers - {(r, c)})


def generate_puzzle(solution: Board, rng: random.Random, clues: int) -> Board:
    """Blank cells of `solution` in shuffled order, keeping each blank only if the solution stays unique,
    until `clues` cells are left (first pass plus up to EXTRA_PASSES reshuffled passes)."""
    puzzle = [row[:] for row in solution]
    cells = [(r, c) for r in range(len(puzzle)) for c in range(len(puzzle))]
    filled = len(cells)
    for _ in range(1 + EXTRA_PASSES):
        rng.shuffle(cells)
        for r, c in cells:
            if filled <= clues:
                return puzzle
            if puzzle[r][c] == 0:
                continue
            value, puzzle[r][c] = puzzle[r][c], 0
            if count_solutions([row[:] for row in puzzle]) == 1:
                filled -= 1
            else:
                puzzle[r][c] = value
        if filled <= clues:
            break
    return puzzle


def parse_move(action: str, size: int = BOX * BOX) -> tuple[int, int, int] | None:
    """Zero-indexed (row, col, value) of `r,c,v` / `r c v` (1-indexed) or `place v at row r col c`;
    None if the string is not a move on the board. Numbers are ASCII digits only."""
    tokens = str(action).lower().replace(",", " ").split()
    if "row" in tokens and "col" in tokens:
        i, j = tokens.index("row"), tokens.index("col")
        if i + 1 >= len(tokens) or j + 1 >= len(tokens):
            return None
        rest = [t for k, t in enumerate(tokens) if k not in (i + 1, j + 1) and is_ascii_number(t)]
        parts = [tokens[i + 1], tokens[j + 1], rest[0] if rest else ""]
    else:
        parts = tokens[:3]
    numbers = [board_number(p, size) for p in parts]
    if len(numbers) < 3 or None in numbers:
        return None
    r, c, v = numbers
    return r - 1, c - 1, v


def is_ascii_number(token: str) -> bool:
    """True for a non-empty run of the digits 0-9. `str.isdigit` alone also accepts characters such as
    '²' or '①', which `int` rejects, and other scripts' digits, which `int` reads (spec §3.4: invalid)."""
    return token.isascii() and token.isdigit()


def board_number(token: str, size: int) -> int | None:
    """The value of `token` if it is an ASCII number in [1, size] (leading zeros allowed), else None.
    Never calls `int` on a long token: `int` refuses strings of more than 4300 digits."""
    significant = token.lstrip("0")
    if not is_ascii_number(token) or len(significant) > len(str(size)):
        return None
    value = int(significant or "0")
    return value if 1 <= value <= size else None


class SudokuEnv(BaseEnv):
    """Fill the board; `board` is the current grid, `clue` marks the cells given at reset."""

    env_type = "sudoku"

    def __init__(self, config: SudokuEnvConfig | None = None) -> None:
        self.config = config or SudokuEnvConfig()
        self.ACTION_LOOKUP = None
        self.board: Board | None = None
        self.solution: Board | None = None
        self.clue: list[list[bool]] = []
        self.current_step = 0

    def reset(self, seed: int | None = None, mode: str | None = None) -> str:
        """Build the puzzle of `seed`; returns the render."""
        rng = random.Random(resolve_seed(seed))
        self.solution = generate_solution(rng, self.config.board_size)
        self.board = generate_puzzle(self.solution, rng, CLUES[self.config.difficulty])
        self.clue = [[v != 0 for v in row] for row in self.board]
        self.current_step = 0
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Write one digit. Unparseable, off-board or clue-cell moves are invalid; a digit already in the
        row, column or sub-box is valid but rejected (board unchanged). Reward 1.0 when the board is
        solved (done); otherwise 0, done once `max_steps` moves were made."""
        self.current_step += 1
        move = parse_move(action, self.config.board_size)
        valid = move is not None and not self.clue[move[0]][move[1]]
        effective = False
        if valid:
            r, c, v = move
            if not conflicts(self.board, r, c, v) and self.board[r][c] != v:
                self.board[r][c] = v
                effective = True
        solved = self.board == self.solution
        done = solved or self.current_step >= self.config.max_steps
        info = {"success": solved, "action_is_valid": valid, "action_is_effective": effective}
        return self.render(), 1.0 if solved else 0.0, done, info

    def render(self) -> str:
        """`| 3 2 4 1 | . 4 . . | ...` (trailing space); with coordinates, the empty cells follow."""
        if self.board is None:
            raise RuntimeError("call reset() before render()")
        text = "".join("| " + "".join(f"{v or '.'} " for v in row) for row in self.board)
        if self.config.render_mode == "text_with_coordinates":
            text += "\n" + self.empty_cells_sentence()
        return text

    def empty_cells_sentence(self) -> str:
        """The 1-indexed empty cells, row-major, as the original's coordinate line."""
        empty = [
            f"({r + 1},{c + 1})" for r, row in enumerate(self.board) for c, v in enumerate(row) if v == 0
        ]
        if not empty:
            return "No empty positions found (board might be complete)."
        if len(empty) == 1:
            return f"Empty position to be filled is at {empty[0]}."
        return f"Empty positions to be filled are at {', '.join(empty)}."

    def get_all_actions(self) -> list[str]:
        """Every move `r,c,v` (1-indexed), row-major then by value."""
        n = self.config.board_size
        return [f"{r},{c},{v}" for r in range(1, n + 1) for c in range(1, n + 1) for v in range(1, n + 1)]

"""Sokoban room generation (spec §3.2): RAGEN's copy of gym-sokoban's generator, which SPA uses.

A room is built in four stages, all drawing from the *global* `random` and legacy `numpy.random`
generators (the caller seeds them, see `base.legacy_global_seed`):

1. topology: a random walk stamps 3x3 floor masks onto a wall grid;
2. placement: the player and then each box are put on random floor cells, every box on its own target;
3. reverse play: a depth-first search "pulls" boxes away from their targets and keeps the state with the
   highest score = (box swaps on the path) x (total Manhattan distance of boxes from their targets); a pull
   is a box swap when it moves a different box than the previous pull on the path (the first always is);
4. (RAGEN) a random walk of up to three player steps.

gym-sokoban 0.0.6 (PyPI) hands the *old* last-pulled box down the search, so it counts every pull as a
swap and gives a different room for about 6% of the seeds; RAGEN's copy, and this module, hand down the
updated one, as spec §3.2 step 4 says.

The search is the expensive part. It visits exactly the states of the original recursive search, in the
same order and with the same tie-breaking, but keeps one flat `bytearray` grid that is changed and
restored in place instead of copying numpy arrays, tracks box positions in a list, and uses the grid's
bytes as the explored-set key (the original used `marshal.dumps` of the array: the same information).

Cell values: 0 wall, 1 floor, 2 target, 3 box on target (during the search: a box that has been pulled),
4 box, 5 player, 6 player on target (render only).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = range(7)
MAX_EXPLORED = 300_000
"""The search stops once this many distinct states have been explored."""

WALK_DIRECTIONS = [(1, 0), (0, 1), (-1, 0), (0, -1)]
MASKS = [
    [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
    [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
    [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
]
MASK_OFFSETS = [[(r - 1, c - 1) for r in range(3) for c in range(3) if mask[r][c]] for mask in MASKS]
"""Each mask as the (row, col) offsets of its ones relative to its centre."""


class RoomGenerationError(RuntimeError):
    """No room for this seed: too few floor cells, or no pull sequence moved a box (score 0)."""


@dataclass
class Room:
    """A generated room. `structure`: (rows, cols) walls/floor/targets; `state`: (rows, cols) with the
    player (5) and boxes (4) placed; `box_mapping`: target (r, c) -> position (r, c) of its box."""

    structure: np.ndarray
    state: np.ndarray
    box_mapping: dict[tuple[int, int], tuple[int, int]]


def generate_room(
    dim: tuple[int, int],
    num_steps: int,
    num_boxes: int,
    search_depth: int = 300,
    p_change_directions: float = 0.35,
    tries: int = 4,
    player_walk: bool = True,
) -> Room:
    """Generate a room from the current global RNG states; `dim` = (rows, cols).

    With `player_walk=False` this is stages 1-3 only (RAGEN's generator without its player walk).
    Raises RoomGenerationError when the seed gives no room.
    """
    rows, cols = dim
    for _ in range(tries):
        room = place_boxes_and_player(topology(dim, p_change_directions, num_steps), num_boxes)
        structure = bytes(FLOOR if v == PLAYER else v for v in room)
        state = bytearray(BOX if v == TARGET else v for v in room)
        best_state, score, boxes = reverse_play(state, structure, cols, search_depth)
        if score > 0:
            break
    if score <= 0:
        raise RoomGenerationError("no pull sequence moved a box (score 0) in any try")
    state = bytearray(BOX if v == BOX_ON_TARGET else v for v in best_state)
    targets = [i for i, v in enumerate(structure) if v == TARGET]
    if player_walk:
        random_player_walk(state, structure, cols, _displacement(boxes, targets, cols))
    mapping = {divmod(t, cols): divmod(b, cols) for t, b in zip(targets, boxes)}
    as_grid = lambda cells: np.frombuffer(bytes(cells), dtype=np.uint8).reshape(rows, cols).copy()
    return Room(as_grid(structure), as_grid(state), mapping)


def topology(dim: tuple[int, int], p_change_directions: float, num_steps: int) -> list[int]:
    """Stage 1: the flat (row-major) floor/wall grid drawn by a random walk of `num_steps` mask stamps."""
    rows, cols = dim
    direction = random.sample(WALK_DIRECTIONS, 1)[0]
    r, c = random.randint(1, rows - 1), random.randint(1, cols - 1)
    level = [WALL] * (rows * cols)
    for _ in range(num_steps):
        if random.random() < p_change_directions:
            direction = random.sample(WALK_DIRECTIONS, 1)[0]
        r = max(min(r + direction[0], rows - 2), 1)
        c = max(min(c + direction[1], cols - 2), 1)
        for dr, dc in random.sample(MASK_OFFSETS, 1)[0]:
            level[(r + dr) * cols + c + dc] = FLOOR
    for i in range(rows * cols):
        r, c = divmod(i, cols)
        if r in (0, rows - 1) or c in (0, cols - 1):
            level[i] = WALL
    return level


def place_boxes_and_player(room: list[int], num_boxes: int) -> list[int]:
    """Stage 2: the player (5) and `num_boxes` targets (2, each holding its box) on random floor cells."""
    floor = [i for i, v in enumerate(room) if v == FLOOR]
    if len(floor) <= num_boxes + 1:
        raise RoomGenerationError(f"only {len(floor)} floor cells for a player and {num_boxes} boxes")
    room[floor[np.random.randint(len(floor))]] = PLAYER
    for _ in range(num_boxes):
        floor = [i for i, v in enumerate(room) if v == FLOOR]
        room[floor[np.random.randint(len(floor))]] = TARGET
    return room


def reverse_play(
    state: bytearray, structure: bytes, cols: int, search_depth: int
) -> tuple[bytes, int, list[int]]:
    """Stage 3: the depth-first pull search from `state` (flat grid, boxes 4 on their targets).

    Returns the best state found (flat grid), its score and the box positions (flat indices, one per
    target in row-major target order). `state` is used as scratch space and restored.
    """
    targets = [i for i, v in enumerate(structure) if v == TARGET]
    boxes = list(targets)
    explored: set[bytes] = set()
    best: list = [-1, bytes(state), list(boxes)]
    deltas = (-cols, cols, -1, 1)
    grid = state

    def visit(player: int, box_swaps: int, last_pull: int, ttl: int, key: bytes) -> None:
        # Entered only for a state not yet explored, with ttl > 0 and the cap not reached.
        # `last_pull`: index in `boxes` of the box pulled last on this path (-1: none yet).
        score = 0
        if box_swaps and all(grid[t] == TARGET for t in targets):
            score = box_swaps * _displacement(boxes, targets, cols)
        if score > best[0]:
            best[:] = [score, key, list(boxes)]
        explored.add(key)
        ttl -= 1
        if ttl <= 0:
            return
        for d in deltas:
            nxt = player + d
            old_nxt = grid[nxt]
            if old_nxt != FLOOR and old_nxt != TARGET:
                continue  # no move: the child is this (explored) state
            if len(explored) >= MAX_EXPLORED:
                return
            behind = player - d
            old_behind = grid[behind]
            pull = old_behind == BOX or old_behind == BOX_ON_TARGET
            grid[nxt] = PLAYER
            k = last_pull
            if pull:
                k = boxes.index(behind)
                boxes[k] = player
                grid[player], grid[behind] = BOX_ON_TARGET, structure[behind]
            else:
                grid[player] = structure[player]
            child = bytes(grid)
            if child not in explored:
                visit(nxt, box_swaps + (k != last_pull), k, ttl, child)
            grid[player], grid[nxt] = PLAYER, old_nxt
            if pull:
                grid[behind] = old_behind
                boxes[k] = behind

    if search_depth > 1:
        visit(grid.index(PLAYER), 0, -1, search_depth - 1, bytes(grid))
    return best[1], best[0], best[2]


def _displacement(boxes: list[int], targets: list[int], cols: int) -> int:
    """Sum of Manhattan distances between each box and the target it started on."""
    total = 0
    for b, t in zip(boxes, targets):
        (br, bc), (tr, tc) = divmod(b, cols), divmod(t, cols)
        total += abs(br - tr) + abs(bc - tc)
    return total


def random_player_walk(state: bytearray, structure: bytes, cols: int, displacement: int) -> None:
    """Stage 4 (RAGEN): with probability 0.8 (displacement 1) or 0.5, walk the player up to 3 steps onto
    floor/target cells not visited before, candidates in the order up, down, left, right; in place."""
    if random.random() > (0.8 if displacement == 1 else 0.5):
        return
    player = state.index(PLAYER)
    visited = {player}
    for step in range(3):
        moves = [player + d for d in (-cols, cols, -1, 1)]
        candidates = [m for m in moves if state[m] in (FLOOR, TARGET) and m not in visited]
        if not candidates:
            return
        nxt = random.choice(candidates)
        state[player], state[nxt] = structure[player], PLAYER
        player = nxt
        visited.add(nxt)
        if step == 2 or random.random() > 0.5:
            return

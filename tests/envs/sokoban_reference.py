"""A plain, slow transcription of the room generator of spec §3.2 as written (RAGEN's copy of
gym-sokoban's generator), used only to check the fast one and to write tests/data/.

It keeps the shape of the original algorithm on purpose: numpy grids copied at every reverse move, a
recursive depth-first search, the explored set keyed by ``marshal.dumps`` of the grid. Written from the
spec, not from gym-sokoban: gym-sokoban 0.0.6 passes the old ``last_pull`` down the search, so it counts
every pull as a box swap and gives a different room for about 6% of the seeds.
"""

from __future__ import annotations

import marshal
import random

import numpy as np

MASKS = [
    [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
    [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
    [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
]
REVERSE_DELTAS = [(-1, 0), (1, 0), (0, -1), (0, 1)]
MAX_EXPLORED = 300_000


def topology(dim, p_change_directions, num_steps):
    dim_x, dim_y = dim
    directions = [(1, 0), (0, 1), (-1, 0), (0, -1)]
    direction = random.sample(directions, 1)[0]
    position = np.array([random.randint(1, dim_x - 1), random.randint(1, dim_y - 1)])
    level = np.zeros(dim, dtype=int)
    for _ in range(num_steps):
        if random.random() < p_change_directions:
            direction = random.sample(directions, 1)[0]
        position = position + direction
        position[0] = max(min(position[0], dim_x - 2), 1)
        position[1] = max(min(position[1], dim_y - 2), 1)
        mask = random.sample(MASKS, 1)[0]
        start = position - 1
        level[start[0] : start[0] + 3, start[1] : start[1] + 3] += mask
    level[level > 0] = 1
    level[:, [0, dim_y - 1]] = 0
    level[[0, dim_x - 1], :] = 0
    return level


def place(room, num_boxes):
    positions = np.where(room == 1)
    count = positions[0].shape[0]
    if count <= num_boxes + 1:
        raise RuntimeError("not enough free cells")
    ind = np.random.randint(count)
    room[positions[0][ind], positions[1][ind]] = 5
    for _ in range(num_boxes):
        positions = np.where(room == 1)
        ind = np.random.randint(positions[0].shape[0])
        room[positions[0][ind], positions[1][ind]] = 2
    return room


class _Search:
    def __init__(self, structure, num_boxes):
        self.structure = structure
        self.num_boxes = num_boxes
        self.explored = set()
        self.best_score = -1
        self.best_room = None
        self.best_mapping = None

    def dfs(self, state, mapping, box_swaps, last_pull, ttl):
        ttl -= 1
        if ttl <= 0 or len(self.explored) >= MAX_EXPLORED:
            return
        key = marshal.dumps(state)
        if key in self.explored:
            return
        score = box_swaps * displacement(mapping)
        if np.where(state == 2)[0].shape[0] != self.num_boxes:
            score = 0
        if score > self.best_score:
            self.best_room, self.best_score, self.best_mapping = state.copy(), score, mapping.copy()
        self.explored.add(key)
        for action in range(4):
            nxt, nxt_mapping, nxt_pull = self.reverse_move(state.copy(), mapping.copy(), last_pull, action)
            # A swap is counted when a different box is pulled than last time, and the child search
            # continues from the updated `last_pull` (RAGEN's copy; gym-sokoban 0.0.6 passes the old one).
            swaps = box_swaps + 1 if nxt_pull != last_pull else box_swaps
            self.dfs(nxt, nxt_mapping, swaps, nxt_pull, ttl)

    def reverse_move(self, state, mapping, last_pull, action):
        where = np.where(state == 5)
        player = np.array([where[0][0], where[1][0]])
        change = REVERSE_DELTAS[action]
        nxt = player + change
        if state[nxt[0], nxt[1]] in (1, 2):
            state[player[0], player[1]] = self.structure[player[0], player[1]]
            state[nxt[0], nxt[1]] = 5
            box = player - change
            if state[box[0], box[1]] in (3, 4):
                state[player[0], player[1]] = 3
                state[box[0], box[1]] = self.structure[box[0], box[1]]
                for k in mapping:
                    if mapping[k] == (box[0], box[1]):
                        mapping[k] = (player[0], player[1])
                        last_pull = k
        return state, mapping, last_pull


def displacement(mapping):
    """Sum over boxes of the Manhattan distance from the box to the target it started on."""
    return sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t, b in mapping.items())


def reverse_playing(state, structure, search_depth):
    targets = np.where(structure == 2)
    mapping = {(targets[0][i], targets[1][i]): (targets[0][i], targets[1][i]) for i in range(len(targets[0]))}
    search = _Search(structure, len(targets[0]))
    search.best_mapping = mapping
    search.dfs(state, mapping, 0, (-1, -1), search_depth)
    return search.best_room, search.best_score, search.best_mapping


def generate_room_core(dim, num_steps, num_boxes, search_depth, p_change_directions=0.35, tries=4):
    """Steps 1-4 of spec §3.2; uses the global RNGs."""
    for _ in range(tries):
        room = place(topology(dim, p_change_directions, num_steps), num_boxes)
        structure = room.copy()
        structure[structure == 5] = 1
        state = room.copy()
        state[state == 2] = 4
        state, score, mapping = reverse_playing(state, structure, search_depth)
        state[state == 3] = 4
        if displacement(mapping) > 0:
            break
    if displacement(mapping) == 0:
        raise RuntimeWarning("Generated Model with score == 0")
    return structure, state, mapping


def player_walk(structure, state, mapping):
    """RAGEN's random walk of up to three player steps (stage 4), on numpy grids."""
    if random.random() > (0.8 if displacement(mapping) == 1 else 0.5):
        return state
    where = np.where(state == 5)
    position = (int(where[0][0]), int(where[1][0]))
    visited = {position}
    for step in range(3):
        candidates = []
        for delta in REVERSE_DELTAS:
            cell = (position[0] + delta[0], position[1] + delta[1])
            if state[cell] in (1, 2) and cell not in visited:
                candidates.append(cell)
        if not candidates:
            break
        cell = random.choice(candidates)
        state[position] = structure[position]
        state[cell] = 5
        position = cell
        visited.add(cell)
        if step == 2 or random.random() > 0.5:
            break
    return state


def generate_room(seed, dim, num_boxes, search_depth=300):
    """The room of `seed` as the env builds it: (structure, state) or None if the seed gives no room."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        structure, state, mapping = generate_room_core(
            dim, int(1.7 * (dim[0] + dim[1])), num_boxes, search_depth
        )
        return structure, player_walk(structure, state, mapping)
    except (RuntimeError, RuntimeWarning):
        return None
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)

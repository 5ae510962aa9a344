"""Sokoban (spec §3.2): env_type `sokoban`, tags SimpleSokoban (6x6, 1 box), HarderSokoban (10x10, 2 boxes)
and the grid/action-vocabulary variants, which differ only in their config.

Moves follow gym-sokoban's "push" actions: the player steps into a free cell, or pushes the box ahead
of it when the cell behind that box is free. Action ids have fixed meanings (1 up, 2 down, 3 left,
4 right); `action_lookup` only names them, so a different action vocabulary relabels the same moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from SPA_agent.envs.base import (
    RENDER_MODES,
    BaseEnv,
    check,
    coordinate_sentence,
    fallback_seed,
    int_keyed,
    legacy_global_seed,
    resolve_seed,
)
from SPA_agent.envs.sokoban_room import (
    BOX,
    BOX_ON_TARGET,
    FLOOR,
    PLAYER,
    PLAYER_ON_TARGET,
    TARGET,
    RoomGenerationError,
    generate_room,
)

MOVES = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}
"""Action id -> (row, col) delta: 1 up, 2 down, 3 left, 4 right."""
MAX_SEED_FALLBACKS = 32
"""Seeds tried (the given one, then `fallback_seed` chained) before reset gives up."""
RENDERS_KEPT = 65536
"""Distinct renders `SokobanEnv.render` remembers (emptied when full)."""
_RENDERS: dict[tuple, str] = {}


@dataclass
class SokobanEnvConfig:
    """Config of `SokobanEnv` (keys of `custom_envs.<Tag>.env_config`)."""

    dim_x: int = 6
    """Rows of the room, walls included."""
    dim_y: int = 6
    """Columns of the room, walls included."""
    num_boxes: int = 1
    """Boxes (and targets) in the room."""
    max_steps: int = 100
    """The episode ends after this many steps."""
    search_depth: int = 300
    """Depth limit of the reverse-play search that places the boxes."""
    render_mode: str = "text"
    """`text` (the grid) or `text_with_coordinates` (the grid and a sentence of coordinates)."""
    grid_lookup: dict = field(
        default_factory=lambda: {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}
    )
    """Cell value -> symbol: 0 wall, 1 floor, 2 target, 3 box on target, 4 box, 5 player, 6 player on target."""
    grid_vocab: dict = field(
        default_factory=lambda: {
            "#": "wall",
            "_": "empty",
            "O": "target",
            "√": "box on target",
            "X": "box",
            "P": "player",
            "S": "player on target",
        }
    )
    """Symbol -> meaning, shown to the model in the prompt."""
    action_lookup: dict = field(default_factory=lambda: {1: "Up", 2: "Down", 3: "Left", 4: "Right"})
    """Action id -> name; ids mean 1 up, 2 down, 3 left, 4 right whatever the names."""
    step_penalty: float = -0.1
    """Reward added on every step."""
    box_reward: float = 1.0
    """Reward per box newly pushed onto a target (its negative when one is pushed off)."""
    solve_reward: float = 10.0
    """Reward added when every box is on a target."""

    def __post_init__(self) -> None:
        check(isinstance(self.dim_x, int) and self.dim_x >= 4, self, "dim_x", "must be an integer >= 4")
        check(isinstance(self.dim_y, int) and self.dim_y >= 4, self, "dim_y", "must be an integer >= 4")
        interior = (self.dim_x - 2) * (self.dim_y - 2)
        check(
            isinstance(self.num_boxes, int) and 1 <= self.num_boxes < interior - 1,
            self,
            "num_boxes",
            f"must be an integer in [1, {interior - 2}] for a {self.dim_x}x{self.dim_y} room",
        )
        check(
            isinstance(self.max_steps, int) and self.max_steps >= 1,
            self,
            "max_steps",
            "must be an integer >= 1",
        )
        check(
            isinstance(self.search_depth, int) and self.search_depth >= 2,
            self,
            "search_depth",
            "must be an integer >= 2",
        )
        check(self.render_mode in RENDER_MODES, self, "render_mode", f"must be one of {RENDER_MODES}")
        self.grid_lookup = int_keyed(self.grid_lookup, self, "grid_lookup")
        check(
            set(self.grid_lookup) == set(range(7)), self, "grid_lookup", "must give a symbol for each of 0..6"
        )
        self.action_lookup = int_keyed(self.action_lookup, self, "action_lookup")
        check(set(self.action_lookup) == set(MOVES), self, "action_lookup", "must name each of the ids 1..4")
        names = [name.lower() for name in self.action_lookup.values()]
        check(len(set(names)) == len(names), self, "action_lookup", "names must differ (case-insensitively)")


class SokobanEnv(BaseEnv):
    """Push every box onto a target. `room_fixed`: (dim_x, dim_y) walls/floor/targets; `room_state`:
    (dim_x, dim_y) with the player (5) and boxes (3 on a target, 4 elsewhere)."""

    env_type = "sokoban"

    def __init__(self, config: SokobanEnvConfig | None = None) -> None:
        self.config = config or SokobanEnvConfig()
        self.ACTION_LOOKUP = self.config.action_lookup
        self._action_ids = {name.lower(): i for i, name in self.config.action_lookup.items()}
        self.room_fixed = self.room_state = None
        self.num_env_steps = 0
        self.seed: int | None = None

    def reset(self, seed: int | None = None, mode: str | None = None) -> str:
        """Generate the room of `seed` (falling back to derived seeds if it has none); returns the render."""
        cfg = self.config
        seed = resolve_seed(seed)
        for _ in range(MAX_SEED_FALLBACKS):
            try:
                with legacy_global_seed(seed):
                    room = generate_room(
                        (cfg.dim_x, cfg.dim_y),
                        int(1.7 * (cfg.dim_x + cfg.dim_y)),
                        cfg.num_boxes,
                        cfg.search_depth,
                    )
                break
            except RoomGenerationError:
                seed = fallback_seed(seed)
        else:
            raise RuntimeError(f"no room after {MAX_SEED_FALLBACKS} seeds; the config {cfg} is too tight")
        self.seed = seed
        self.room_fixed, self.room_state = room.structure, room.state
        self.num_env_steps = 0
        return self.render()

    def step(self, action: int | str) -> tuple[str, float, bool, dict]:
        """Move once (pushing a box if one is ahead); returns render, reward, done, info.

        `action` is an id of `action_lookup` or its name (any case). Anything else is an invalid action:
        nothing moves, the step counts and gets the step penalty, `info["action_is_valid"]` is False.
        """
        action_id = self.action_id(action)
        before = self.room_state
        if action_id is not None:
            self.room_state = push(before, self.room_fixed, MOVES[action_id])
        placed = boxes_on_target(self.room_state) - boxes_on_target(before)
        solved = boxes_on_target(self.room_state) == self.config.num_boxes
        self.num_env_steps += 1
        cfg = self.config
        reward = cfg.step_penalty + cfg.box_reward * np.sign(placed) + cfg.solve_reward * solved
        done = solved or self.num_env_steps >= cfg.max_steps
        info = {
            "success": bool(solved),
            "action_is_valid": action_id is not None,
            "action_is_effective": not np.array_equal(before, self.room_state),
        }
        return self.render(), float(reward), bool(done), info

    def action_id(self, action: int | str) -> int | None:
        """The id of `action` (an id or a name), or None if it names no action."""
        if isinstance(action, str):
            return self._action_ids.get(action.strip().lower())
        if isinstance(action, (int, np.integer)) and not isinstance(action, bool) and int(action) in MOVES:
            return int(action)
        return None

    def render(self) -> str:
        """Rows of symbols joined by newlines; with coordinates, a sentence follows on its own line. (A rollout
        renders every step: plain lists of a few dozen cells are several times faster than numpy calls here.)"""
        if self.room_state is None:
            raise RuntimeError("call reset() before render()")
        state, fixed, cfg = self.room_state, self.room_fixed, self.config
        # A render is a function of exactly these: remembered across envs (a group's envs start from one room and
        # revisit states; the env's step renders the state the rollout renders again right after).
        key = (state.shape, state.dtype.str, state.tobytes(), fixed.shape, fixed.dtype.str, fixed.tobytes(),
               cfg.render_mode, tuple(cfg.grid_lookup.items()))
        text = _RENDERS.get(key)
        if text is None:
            if len(_RENDERS) >= RENDERS_KEPT:
                _RENDERS.clear()
            text = _RENDERS[key] = self._render()
        return text

    def _render(self) -> str:
        lookup = self.config.grid_lookup
        state, fixed = self.room_state.tolist(), self.room_fixed.tolist()
        text = "\n".join(
            "".join(lookup[PLAYER_ON_TARGET if v == PLAYER and f == TARGET else v] for v, f in zip(row, fixed_row))
            for row, fixed_row in zip(state, fixed)
        )
        if self.config.render_mode == "text_with_coordinates":
            text += "\n" + self._coordinates(state, fixed)
        return text

    def coordinates(self) -> str:
        """`Player (P) is at (r,c); box (X) is at (r,c); target (O) is at (r,c).` (zero-indexed, row-major;
        a box or player standing on a target is reported as both)."""
        return self._coordinates(self.room_state.tolist(), self.room_fixed.tolist())

    def _coordinates(self, state: list[list[int]], fixed: list[list[int]]) -> str:
        lookup = self.config.grid_lookup
        cells = lambda grid, kinds: [(r, c) for r, row in enumerate(grid) for c, v in enumerate(row) if v in kinds]
        return coordinate_sentence(
            [(f"Player ({lookup[PLAYER]})", p) for p in cells(state, (PLAYER,))]
            + [(f"box ({lookup[BOX]})", b) for b in cells(state, (BOX, BOX_ON_TARGET))]
            + [(f"target ({lookup[TARGET]})", t) for t in cells(fixed, (TARGET,))]
        )

    def get_all_actions(self) -> list[str]:
        """Action names in id order."""
        return [self.config.action_lookup[i] for i in sorted(self.config.action_lookup)]


def push(state: np.ndarray, fixed: np.ndarray, delta: tuple[int, int]) -> np.ndarray:
    """The state after one gym-sokoban push action (a new array; `state` is unchanged).

    Nothing moves if the cell two steps ahead lies beyond the grid's lower/right edge (gym-sokoban's
    bounds check; the outer walls make it irrelevant in generated rooms).
    """
    ((r, c),) = zip(*np.nonzero(state == PLAYER))
    ahead, beyond = (r + delta[0], c + delta[1]), (r + 2 * delta[0], c + 2 * delta[1])
    if beyond[0] >= state.shape[0] or beyond[1] >= state.shape[1]:
        return state
    new = state.copy()
    if state[ahead] in (BOX, BOX_ON_TARGET) and state[beyond] in (FLOOR, TARGET):
        new[beyond] = BOX_ON_TARGET if fixed[beyond] == TARGET else BOX
    elif state[ahead] not in (FLOOR, TARGET):
        return state
    new[ahead], new[r, c] = PLAYER, fixed[r, c]
    return new


def boxes_on_target(state: np.ndarray) -> int:
    """Number of boxes standing on targets."""
    return int(np.count_nonzero(state == BOX_ON_TARGET))

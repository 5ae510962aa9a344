"""FrozenLake (spec §3.3): env_type `frozen_lake`, tags FrozenLake (4x4) and FrozenLake6x6.

Our map generator (random start and goal, holes with probability 1 - p, redrawn until the goal is
reachable); gymnasium's `FrozenLakeEnv` supplies the transitions: on slippery ice the executed
direction is the intended one or one of its two perpendiculars, 1/3 each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake

from SPA_agent.envs.base import RENDER_MODES, BaseEnv, check, coordinate_sentence, int_keyed, resolve_seed

GYM_ACTIONS = {1: 0, 2: 1, 3: 2, 4: 3}
"""Our action id -> gymnasium's: 1 Left -> 0 LEFT, 2 Down -> 1 DOWN, 3 Right -> 2 RIGHT, 4 Up -> 3 UP."""


@dataclass
class FrozenLakeEnvConfig:
    """Config of `FrozenLakeEnv` (keys of `custom_envs.<Tag>.env_config`)."""

    size: int = 4
    """Rows and columns of the square map."""
    p: float = 0.8
    """Probability that a generated cell is frozen (walkable); holes get 1 - p."""
    is_slippery: bool = True
    """Slide to a perpendicular direction two times in three."""
    map_seed: int | None = None
    """If set, every reset uses the map of this seed (the reset seed then only seeds the slipping)."""
    render_mode: str = "text"
    """`text` (the grid) or `text_with_coordinates` (the grid and a sentence of coordinates)."""
    grid_lookup: dict = field(default_factory=lambda: {0: "P", 1: "_", 2: "O", 3: "G", 4: "X", 5: "√"})
    """Cell kind -> symbol: 0 player, 1 frozen (the start too), 2 hole, 3 goal, 4 player in a hole,
    5 player on the goal."""
    grid_vocab: dict = field(
        default_factory=lambda: {
            "P": "player",
            "_": "empty",
            "O": "hole",
            "G": "goal",
            "X": "player in hole",
            "√": "player on goal",
        }
    )
    """Symbol -> meaning, shown to the model in the prompt."""
    action_lookup: dict = field(default_factory=lambda: {1: "Left", 2: "Down", 3: "Right", 4: "Up"})
    """Action id -> name; ids mean 1 left, 2 down, 3 right, 4 up whatever the names."""

    def __post_init__(self) -> None:
        check(isinstance(self.size, int) and self.size >= 2, self, "size", "must be an integer >= 2")
        check(
            isinstance(self.p, (int, float)) and not isinstance(self.p, bool) and 0 < self.p <= 1,
            self,
            "p",
            "must be a probability in (0, 1]",
        )
        check(isinstance(self.is_slippery, bool), self, "is_slippery", "must be true or false")
        check(
            self.map_seed is None or (isinstance(self.map_seed, int) and self.map_seed >= 0),
            self,
            "map_seed",
            "must be null or an integer >= 0",
        )
        check(self.render_mode in RENDER_MODES, self, "render_mode", f"must be one of {RENDER_MODES}")
        self.grid_lookup = int_keyed(self.grid_lookup, self, "grid_lookup")
        check(
            set(self.grid_lookup) == set(range(6)), self, "grid_lookup", "must give a symbol for each of 0..5"
        )
        self.action_lookup = int_keyed(self.action_lookup, self, "action_lookup")
        check(
            set(self.action_lookup) == set(GYM_ACTIONS),
            self,
            "action_lookup",
            "must name each of the ids 1..4",
        )
        names = [name.lower() for name in self.action_lookup.values()]
        check(len(set(names)) == len(names), self, "action_lookup", "names must differ (case-insensitively)")


def generate_random_map(size: int, p: float, seed: int) -> list[str]:
    """Rows of `F` frozen, `H` hole, `S` start, `G` goal, drawn with numpy's PCG64 generator of `seed`
    until start != goal and a 4-neighbour path over non-holes joins them."""
    rng = np.random.default_rng(seed)
    while True:
        board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
        start, goal = tuple(rng.integers(size, size=2)), tuple(rng.integers(size, size=2))
        if start == goal:
            continue
        board[start], board[goal] = "S", "G"
        if _reachable(board, start, goal):
            return ["".join(row) for row in board]


def _reachable(board: np.ndarray, start: tuple[int, int], goal: tuple[int, int]) -> bool:
    size = board.shape[0]
    stack, seen = [start], {start}
    while stack:
        r, c = stack.pop()
        if (r, c) == goal:
            return True
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= nr < size and 0 <= nc < size and (nr, nc) not in seen and board[nr, nc] != "H":
                seen.add((nr, nc))
                stack.append((nr, nc))
    return False


class FrozenLakeEnv(BaseEnv):
    """Reach the goal without falling into a hole; `desc` is the map (rows of S/F/H/G)."""

    env_type = "frozen_lake"

    def __init__(self, config: FrozenLakeEnvConfig | None = None) -> None:
        self.config = config or FrozenLakeEnvConfig()
        self.ACTION_LOOKUP = self.config.action_lookup
        self._action_ids = {name.lower(): i for i, name in self.config.action_lookup.items()}
        self.desc: list[str] | None = None
        self._gym: GymFrozenLake | None = None

    def reset(self, seed: int | None = None, mode: str | None = None) -> str:
        """Build the map of `seed` (or of `map_seed`), seed the slipping with `seed`; returns the render."""
        seed = resolve_seed(seed)
        map_seed = seed if self.config.map_seed is None else self.config.map_seed
        self.desc = generate_random_map(self.config.size, self.config.p, map_seed)
        self._gym = GymFrozenLake(desc=self.desc, is_slippery=self.config.is_slippery)
        self._gym.reset(seed=seed)
        return self.render()

    @property
    def player(self) -> tuple[int, int]:
        """Zero-indexed (row, col) of the player."""
        return divmod(int(self._gym.s), self.config.size)

    def step(self, action: int | str) -> tuple[str, float, bool, dict]:
        """One (possibly slipping) move; reward 1.0 on reaching the goal; done on the goal or a hole.

        `action` is an id of `action_lookup` or its name (any case); anything else is an invalid action:
        nothing moves, reward 0, not done, `info["action_is_valid"]` False.
        """
        action_id = self.action_id(action)
        before = self.player
        reward, done = 0.0, False
        if action_id is not None:
            _, reward, done, _, _ = self._gym.step(GYM_ACTIONS[action_id])
        r, c = self.player
        info = {
            "success": self.desc[r][c] == "G",
            "action_is_valid": action_id is not None,
            "action_is_effective": (r, c) != before,
        }
        return self.render(), float(reward), bool(done), info

    def action_id(self, action: int | str) -> int | None:
        """The id of `action` (an id or a name), or None if it names no action."""
        if isinstance(action, str):
            return self._action_ids.get(action.strip().lower())
        if (
            isinstance(action, (int, np.integer))
            and not isinstance(action, bool)
            and int(action) in GYM_ACTIONS
        ):
            return int(action)
        return None

    def _symbol(self, r: int, c: int) -> str:
        kind = {"S": 1, "F": 1, "H": 2, "G": 3}[self.desc[r][c]]
        if (r, c) == self.player:
            kind = {1: 0, 2: 4, 3: 5}[kind]
        return self.config.grid_lookup[kind]

    def render(self) -> str:
        """Rows of symbols joined by newlines; with coordinates, a sentence follows on its own line."""
        if self.desc is None:
            raise RuntimeError("call reset() before render()")
        size = self.config.size
        text = "\n".join("".join(self._symbol(r, c) for c in range(size)) for r in range(size))
        if self.config.render_mode == "text_with_coordinates":
            text += "\n" + self.coordinates()
        return text

    def coordinates(self) -> str:
        """`Player (P) is at (r,c); hole (O) is at (r,c); ...; goal (G) is at (r,c).` (zero-indexed,
        holes row-major; a player in a hole or on the goal is reported as both)."""
        lookup, size = self.config.grid_lookup, self.config.size
        cells = [(r, c) for r in range(size) for c in range(size)]
        return coordinate_sentence(
            [(f"Player ({lookup[0]})", self.player)]
            + [(f"hole ({lookup[2]})", rc) for rc in cells if self.desc[rc[0]][rc[1]] == "H"]
            + [(f"goal ({lookup[3]})", rc) for rc in cells if self.desc[rc[0]][rc[1]] == "G"]
        )

    def get_all_actions(self) -> list[str]:
        """Action names in id order."""
        return [self.config.action_lookup[i] for i in sorted(self.config.action_lookup)]

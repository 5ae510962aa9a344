"""The SPA environments as gymnasium environments: `gymnasium.make("SPA/Sokoban-v0")`,
`"SPA/FrozenLake-v0"`, `"SPA/Sudoku-v0"`, `"SPA/Bandit-v0"` (registered on `import SPA_agent.envs`).

Observations are the text renders (`gymnasium.spaces.Text`); actions are indices into
`get_all_actions()` (`Discrete`); `step` returns gymnasium's 5-tuple. An episode is *terminated* when the
env ends it on its own (solved, fell into a hole) and *truncated* when it hits its step limit.
Keyword arguments of `gymnasium.make` are the env_config keys, e.g.
`gymnasium.make("SPA/Sokoban-v0", dim_x=10, dim_y=10, num_boxes=2)`.
"""

from __future__ import annotations

import string
from typing import Any, ClassVar

import gymnasium
from gymnasium import spaces

from SPA_agent.envs.base import MAX_SEED, REGISTRY, BaseEnv, build_config

GYM_IDS = {"sokoban": "SPA/Sokoban-v0", "frozen_lake": "SPA/FrozenLake-v0", "sudoku": "SPA/Sudoku-v0",
           "bandit": "SPA/Bandit-v0"}
CHARSET = frozenset(string.ascii_letters + string.digits + " \n_#.,;:|()√✓*@")
"""Characters a render may contain, besides the symbols of the config's `grid_lookup`."""


class TextGymEnv(gymnasium.Env):
    """A gymnasium view of one `BaseEnv`; `render_mode="ansi"` makes `render()` return the text."""

    metadata: ClassVar[dict] = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, env_type: str, render_mode: str | None = None, **env_config: Any) -> None:
        env_class, config_class = REGISTRY[env_type]
        self.env: BaseEnv = env_class(build_config(config_class, env_config))
        self.render_mode = render_mode
        self.actions = self.env.get_all_actions()
        self.action_space = spaces.Discrete(len(self.actions))
        symbols = getattr(self.env.config, "grid_lookup", {}) or {}
        charset = CHARSET | {ch for symbol in symbols.values() for ch in symbol}
        self.observation_space = spaces.Text(max_length=_max_length(self.env), charset=frozenset(charset))

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """Start the instance of `seed`; without one, the next seed is drawn from `self.np_random`."""
        super().reset(seed=seed)
        env_seed = seed if seed is not None else int(self.np_random.integers(MAX_SEED))
        return self.env.reset(seed=env_seed), {}

    def step(self, action: int) -> tuple[str, float, bool, bool, dict]:
        """Apply action `self.actions[action]`; returns (observation, reward, terminated, truncated, info)."""
        if not self.action_space.contains(action):
            raise ValueError(f"action={action!r}: must be an integer in [0, {len(self.actions)})")
        observation, reward, done, info = self.env.step(self._inner_action(int(action)))
        terminated = done and (info["success"] or not _at_step_limit(self.env))
        return observation, reward, terminated, done and not terminated, info

    def _inner_action(self, index: int) -> Any:
        lookup = getattr(self.env.config, "action_lookup", None)
        return sorted(lookup)[index] if lookup else self.actions[index]

    def render(self) -> str | None:
        """The text render when `render_mode="ansi"`."""
        return self.env.render() if self.render_mode == "ansi" else None


def _at_step_limit(env: BaseEnv) -> bool:
    steps = getattr(env, "num_env_steps", getattr(env, "current_step", None))
    limit = getattr(env.config, "max_steps", None)
    return steps is not None and limit is not None and steps >= limit


def _max_length(env: BaseEnv) -> int:
    """A bound on the render length: every cell and newline, plus ~16 characters per reported cell."""
    cfg = env.config
    if env.env_type == "bandit":  # `Pulls left: N. The last pull (<name>) paid <payoff>.`
        return 64 + max(len(name) for name in cfg.action_lookup.values()) + len(f"{cfg.payoff:g}")
    rows = getattr(cfg, "dim_x", None) or getattr(cfg, "size", None) or cfg.board_size
    cols = getattr(cfg, "dim_y", None) or getattr(cfg, "size", None) or cfg.board_size
    symbol = max((len(s) for s in (getattr(cfg, "grid_lookup", None) or {0: "."}).values()), default=1)
    return rows * (cols * max(symbol, 2) + 3) + 32 * rows * cols + 80


def make_gym_env(env_type: str, render_mode: str | None = None, **env_config: Any) -> TextGymEnv:
    """Entry point used by the gymnasium registrations."""
    return TextGymEnv(env_type, render_mode=render_mode, **env_config)


def register_gym_envs() -> None:
    """Register the env types under their `GYM_IDS` (idempotent)."""
    for env_type, gym_id in GYM_IDS.items():
        if gym_id not in gymnasium.registry:
            gymnasium.register(
                id=gym_id,
                entry_point="SPA_agent.envs.gym_adapter:make_gym_env",
                kwargs={"env_type": env_type},
            )

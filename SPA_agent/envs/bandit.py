"""A two-armed bandit (RAGEN has one): env_type `bandit`, tag Bandit. The task of the PPO learning test.

Two named arms; pulling the paying arm gives `payoff`, the other arm gives 0. Nothing is random and the
optimum is known (always pull the paying arm), so a policy that starts at chance must reach a success rate
near 1 if PPO learns. The seed is accepted for the protocol and changes nothing. An episode is `num_pulls`
pulls; it succeeds when every pull took the paying arm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from SPA_agent.envs.base import RENDER_MODES, BaseEnv, check, int_keyed, resolve_seed


@dataclass
class BanditEnvConfig:
    """Config of `BanditEnv` (keys of `custom_envs.<Tag>.env_config`)."""

    action_lookup: dict = field(default_factory=lambda: {1: "Red", 2: "Blue"})
    """Arm id -> arm name; the model answers with a name (any case)."""
    paying_arm: int = 2
    """Id of the arm that pays."""
    payoff: float = 1.0
    """Reward of a pull of the paying arm (the other arm gives 0)."""
    num_pulls: int = 1
    """Pulls per episode."""
    render_mode: str = "text"
    """`text` or `text_with_coordinates`; a bandit has no coordinates, so both render the same."""

    def __post_init__(self) -> None:
        self.action_lookup = int_keyed(self.action_lookup, self, "action_lookup")
        check(len(self.action_lookup) == 2, self, "action_lookup", "must name exactly two arms")
        names = [name.lower() for name in self.action_lookup.values()]
        check(len(set(names)) == 2, self, "action_lookup", "names must differ (case-insensitively)")
        check(self.paying_arm in self.action_lookup, self, "paying_arm", "must be an id of action_lookup")
        check(
            isinstance(self.payoff, (int, float)) and not isinstance(self.payoff, bool) and self.payoff > 0,
            self,
            "payoff",
            "must be a number > 0",
        )
        check(
            isinstance(self.num_pulls, int) and self.num_pulls >= 1, self, "num_pulls", "must be an integer >= 1"
        )
        check(self.render_mode in RENDER_MODES, self, "render_mode", f"must be one of {RENDER_MODES}")


class BanditEnv(BaseEnv):
    """Pull one of two arms per step; `pulls` lists the arm ids pulled so far."""

    env_type = "bandit"

    def __init__(self, config: BanditEnvConfig | None = None) -> None:
        self.config = config or BanditEnvConfig()
        self._action_ids = {name.lower(): i for i, name in self.config.action_lookup.items()}
        self.pulls: list[int] | None = None

    def reset(self, seed: int | None = None, mode: str | None = None) -> str:
        """A fresh episode (every seed gives the same one); returns the render."""
        resolve_seed(seed)
        self.pulls = []
        return self.render()

    def step(self, action: int | str) -> tuple[str, float, bool, dict]:
        """Pull the arm named (or numbered) by `action`; an unknown arm is an invalid action that pulls nothing."""
        if self.pulls is None:
            raise RuntimeError("call reset() before step()")
        if len(self.pulls) >= self.config.num_pulls:
            raise RuntimeError("the episode is over: call reset()")
        arm = self.action_id(action)
        reward = 0.0
        if arm is not None:
            self.pulls.append(arm)
            reward = float(self.config.payoff) if arm == self.config.paying_arm else 0.0
        done = len(self.pulls) >= self.config.num_pulls
        success = done and all(pull == self.config.paying_arm for pull in self.pulls)
        info = {"success": success, "action_is_valid": arm is not None, "action_is_effective": arm is not None}
        return self.render(), reward, done, info

    def action_id(self, action: int | str) -> int | None:
        """The id of `action` (an id or a name), or None if it names no arm."""
        if isinstance(action, str):
            return self._action_ids.get(action.strip().lower())
        if isinstance(action, (int, np.integer)) and not isinstance(action, bool):
            return int(action) if int(action) in self.config.action_lookup else None
        return None

    def render(self) -> str:
        """`Pulls left: N.` followed, after a pull, by what it paid."""
        if self.pulls is None:
            raise RuntimeError("call reset() before render()")
        text = f"Pulls left: {self.config.num_pulls - len(self.pulls)}."
        if self.pulls:
            last = self.pulls[-1]
            paid = self.config.payoff if last == self.config.paying_arm else 0.0
            text += f" The last pull ({self.config.action_lookup[last]}) paid {paid:g}."
        return text

    def get_all_actions(self) -> list[str]:
        """Arm names in id order."""
        return [self.config.action_lookup[i] for i in sorted(self.config.action_lookup)]

"""Expert generator: an exact shortest-path solver plays the puzzles (issue 43, part 1).

Where the random generator gives the floor of imitation (uniform actions), this one gives its ceiling: every
turn it solves the env's true current state by breadth-first search and answers the next `num_actions` moves of
a shortest plan, in the same response format as the random generator. Re-solving each turn keeps it on an
optimal path whatever happened before (a shortest plan from any state it reaches is the rest of a shortest plan).

Why the generator reads the env: a solver needs the true state, which no text generator may see. The agent
proxy therefore hands a *copy* of each env (`Prompt.env`) only to generators that declare `needs_env = True`;
model generators never get it, and the copy cannot change the rollout.

Sokoban only (env_type `sokoban`). FrozenLake is not supported: its ice is slippery (each move goes one of three
ways) and the actions of one turn run without seeing where the player slid, so a shortest path on the grid is
not the optimal policy (that would be a finite-horizon dynamic program over open-loop action chunks).
"""

from __future__ import annotations

import copy
import random as _random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from SPA_agent.envs.sokoban import MOVES
from SPA_agent.envs.sokoban_room import BOX, BOX_ON_TARGET, PLAYER, TARGET, WALL
from SPA_agent.generators import ENV_TYPES
from SPA_agent.generators.base import FINISH_STOP, Generation, Prompt
from SPA_agent.generators.random import ACTION_SEPARATOR, DEFAULT_REASONING

SOLVABLE_ENV_TYPES = ENV_TYPES["solver"]
"""Env types the solver plays (`sokoban`)."""
DEFAULT_MAX_STATES = 1_000_000
"""Search states explored before a room counts as unsolved (a 6×6 room with one box has a few hundred)."""


# --- Sokoban search ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SokobanRoom:
    """A room as cell indices (row · cols + col): `walls`, `targets`, the `player` and the `boxes` (sorted).

    The room must be enclosed by walls, as generated rooms are; then the env's push rule (sokoban.push) reads:
    the player steps into a free cell (floor or target), or pushes the box ahead of it when the cell behind that
    box is free; anything else leaves the state unchanged.
    """

    cols: int
    walls: frozenset[int]
    targets: frozenset[int]
    player: int
    boxes: tuple[int, ...]

    @classmethod
    def from_arrays(cls, room_fixed: np.ndarray, room_state: np.ndarray) -> SokobanRoom:
        """The room of `SokobanEnv.room_fixed` (walls/floor/targets) and `room_state` (player and boxes)."""
        rows, cols = room_fixed.shape
        border = np.ones_like(room_fixed, dtype=bool)
        border[1:-1, 1:-1] = False
        if np.any(room_fixed[border] != WALL):
            raise ValueError("the solver needs a room enclosed by walls (every generated room is)")
        cells = lambda mask: frozenset(int(i) for i in np.flatnonzero(mask))
        (player,) = np.flatnonzero(room_state == PLAYER)
        return cls(cols, cells(room_fixed == WALL), cells(room_fixed == TARGET), int(player),
                   tuple(sorted(cells(np.isin(room_state, (BOX, BOX_ON_TARGET))))))

    @classmethod
    def from_env(cls, env) -> SokobanRoom:
        return cls.from_arrays(env.room_fixed, env.room_state)

    def delta(self, action_id: int) -> int:
        """The cell-index step of an action id (sokoban.MOVES)."""
        dr, dc = MOVES[action_id]
        return dr * self.cols + dc

    def move(self, player: int, boxes: tuple[int, ...], action_id: int) -> tuple[int, tuple[int, ...]] | None:
        """(player, boxes) after `action_id`, or None when the action changes nothing (sokoban.push's rule)."""
        step = self.delta(action_id)
        ahead, beyond = player + step, player + 2 * step
        if ahead in self.walls:
            return None
        if ahead not in boxes:
            return ahead, boxes
        if beyond in self.walls or beyond in boxes:
            return None
        return ahead, tuple(sorted(beyond if box == ahead else box for box in boxes))


def solve_sokoban(room: SokobanRoom, max_states: int = DEFAULT_MAX_STATES) -> list[int] | None:
    """A shortest plan (action ids) that puts every box on a target, or None when there is none within
    `max_states` explored states.

    Breadth-first search over (player, boxes), expanding actions in id order (1 up, 2 down, 3 left, 4 right) and
    keeping the first path to each state: the plan returned is the lexicographically first of the shortest plans
    in that order, so ties break the same way every time. Moves that change nothing are never on a shortest plan
    and are not expanded.
    """
    start = (room.player, room.boxes)
    parents: dict[tuple, tuple[tuple, int] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if room.targets.issuperset(state[1]):  # every box on a target (the env's success)
            return _plan_to(state, parents)
        for action_id in sorted(MOVES):
            after = room.move(*state, action_id)
            if after is not None and after not in parents:
                if len(parents) >= max_states:
                    return None
                parents[after] = (state, action_id)
                queue.append(after)
    return None


def _plan_to(state: tuple, parents: Mapping[tuple, tuple[tuple, int] | None]) -> list[int]:
    plan = []
    while parents[state] is not None:
        state, action_id = parents[state]
        plan.append(action_id)
    return plan[::-1]


def plan_actions(env, max_states: int = DEFAULT_MAX_STATES) -> list[str] | None:
    """A shortest plan for `env`'s current state as action names (its `action_lookup`), or None (unsolved)."""
    if getattr(env, "env_type", None) not in SOLVABLE_ENV_TYPES:
        raise ValueError(f"generator=solver plays env types {list(SOLVABLE_ENV_TYPES)}, not "
                         f"{getattr(env, 'env_type', type(env).__name__)!r}")
    plan = solve_sokoban(SokobanRoom.from_env(env), max_states)
    return None if plan is None else [env.config.action_lookup[action_id] for action_id in plan]


# --- generator ----------------------------------------------------------------------------------------
class SolverGenerator:
    """Answers the next `num_actions` moves of a shortest plan from each prompt's env (`Prompt.env`).

    The text has the random generator's format. In world-model mode the `<observation>` is the env's render and
    the `<prediction>` the render after the answered moves, both computed on the copy: the expert's own states are
    the true ones (stage 1's ground-truth substitution writes the same text again). A room with no plan within
    `max_states` gets `num_actions` random actions (seeded) instead; `card_stats()` counts such turns.
    """

    needs_env = True  # the agent proxy fills Prompt.env with a copy of the env

    def __init__(self, num_actions: int = 5, max_states: int = DEFAULT_MAX_STATES, seed: int = 0,
                 reasoning: str = DEFAULT_REASONING):
        if num_actions < 1:
            raise ValueError(f"generator.num_actions must be >= 1, got {num_actions}")
        if max_states < 1:
            raise ValueError(f"generator.max_states must be >= 1, got {max_states}")
        self.num_actions = num_actions
        self.max_states = max_states
        self.reasoning = reasoning
        self._rng = _random.Random(seed)
        self._counts = {"solved_turns": 0, "fallback_turns": 0}

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> SolverGenerator:
        return cls(
            num_actions=int(cfg.get("num_actions", 5)),
            max_states=int(cfg.get("max_states", DEFAULT_MAX_STATES)),
            seed=int(cfg.get("seed", 0)),
            reasoning=str(cfg.get("reasoning", DEFAULT_REASONING)),
        )

    def card_stats(self) -> dict[str, int]:
        """Turns answered from a plan (`solved_turns`) and from the random fallback (`fallback_turns`) since the
        last call; the counters restart."""
        counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        return [Generation(self._respond(prompt), None, FINISH_STOP) for prompt in prompts]

    def _respond(self, prompt: Prompt) -> str:
        if prompt.env is None:
            raise ValueError("the solver generator needs Prompt.env (a copy of the env); the agent proxy sets it "
                             "for generators with needs_env = True")
        env = prompt.env
        observation = env.render()
        plan = plan_actions(env, self.max_states)
        if plan is None:
            self._counts["fallback_turns"] += 1
            actions = [self._rng.choice(env.get_all_actions()) for _ in range(self.num_actions)]
        else:
            self._counts["solved_turns"] += 1
            actions = plan[: self.num_actions]
        answer = ACTION_SEPARATOR.join(actions)
        if prompt.response_prefix.strip() == "<answer>":
            return f"{answer}</answer>"
        if not prompt.worldmodel:
            return f" {self.reasoning} </think><answer>{answer}</answer>"
        env = copy.deepcopy(env)  # the prompt's copy stays as it was given
        for action in actions:
            env.step(action)
        return (f" <observation>{observation}</observation> {self.reasoning} "
                f"<prediction>{env.render()}</prediction></think><answer>{answer}</answer>")

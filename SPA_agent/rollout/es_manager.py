"""EnvStateManager: env groups, seeds, stepping, the rollout cache and per-env metrics (spec §5).

Knows environments and action names; no tokenizer, no torch, no prompt text.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from SPA_agent.config import close_matches
from SPA_agent.envs import make_env
from SPA_agent.rollout.turns import EnvCache, EnvRecord, Observation, Turn, as_entry, read_entry


@dataclass
class EnvInput:
    """One env's share of a turn: what the model said and the actions parsed from it."""

    env_id: int
    actions: list[str]
    llm_response: str
    llm_raw_response: str
    format_ok: bool = True
    parsed: dict = field(default_factory=dict)
    response_ids: list[int] | None = None


@dataclass
class EnvEntry:
    tag: str
    group_id: int
    env_id: int
    env: Any
    max_actions_per_traj: int
    seed: int | None = None
    num_actions: int = 0
    terminated: bool = False
    truncated: bool = False
    rewards: list[float] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)


def check_env_groups(config: Mapping, split: str) -> None:
    """Clear errors for `es_manager.<split>` before any env is built (or model loaded), each naming the key: group
    counts, known tags, one n_groups entry per tag, and n_groups summing to env_groups."""
    es_cfg = config["es_manager"][split]
    for key in ("env_groups", "group_size"):
        value = es_cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"es_manager.{split}.{key} must be an integer >= 1, got {value!r}")
    tags, n_groups = list(es_cfg["env_configs"]["tags"]), list(es_cfg["env_configs"]["n_groups"])
    known = sorted(config["custom_envs"])
    for tag in tags:
        if tag not in config["custom_envs"]:
            raise ValueError(f"es_manager.{split}.env_configs.tags: unknown env tag {tag!r}"
                             f"{close_matches(str(tag), known)}; known tags: {', '.join(known)}")
    if len(tags) != len(n_groups) or sum(n_groups) != int(es_cfg["env_groups"]):
        raise ValueError(
            f"es_manager.{split}: env_configs.n_groups {n_groups} must have one entry per tag "
            f"{tags} and sum to env_groups={es_cfg['env_groups']}"
        )


def _action_ids_by_name(env) -> dict[str, Any] | None:
    lookup = getattr(env.config, "action_lookup", None)
    if not lookup:
        return None
    return {str(name).lower(): action_id for action_id, name in lookup.items()}


class EnvStateManager:
    """Holds `env_groups × group_size` envs of one split (`train` or `val`) and steps them."""

    def __init__(self, config: Mapping, split: str):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.split = split
        es_cfg = config["es_manager"][split]
        self.group_size = int(es_cfg["group_size"])
        self.env_groups = int(es_cfg["env_groups"])
        self.format_penalty = float(config["es_manager"]["format_penalty"])
        self.base_seed = config["seed"][split] if "seed" in config else None
        self.seed_counter = 0
        check_env_groups(config, split)
        self.entries = self._build_entries(config["custom_envs"], es_cfg["env_configs"])
        self.cache: list[EnvCache] = []

    def _build_entries(self, custom_envs: Mapping, env_configs: Mapping) -> list[EnvEntry]:
        entries, env_id = [], 0
        for tag, n_group in zip(env_configs["tags"], env_configs["n_groups"]):
            env_cfg = custom_envs[tag]
            for _ in range(n_group * self.group_size):
                env = make_env(env_cfg["env_type"], env_cfg.get("env_config"))
                entries.append(EnvEntry(tag, env_id // self.group_size, env_id, env,
                                        int(env_cfg["max_actions_per_traj"])))
                env_id += 1
        return entries

    # --- seeds ------------------------------------------------------------------------------------
    def next_seed(self, seed: int | None = None) -> int:
        """Seed of group 0 for the next reset (spec §5.2); group g uses seed + g."""
        if self.split == "val":
            return self.base_seed if self.base_seed is not None else 0
        if seed is not None:
            if self.base_seed is not None:
                self.seed_counter = seed - self.base_seed + 1
            return seed
        if self.base_seed is None:
            return random.randint(0, 1_000_000)
        seed = self.base_seed + self.seed_counter
        self.seed_counter += self.env_groups
        return seed

    def state_dict(self) -> dict:
        return {"seed_counter": self.seed_counter}

    def load_state_dict(self, state: Mapping) -> None:
        self.seed_counter = int(state["seed_counter"])

    # --- episodes ---------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> list[EnvCache]:
        """Reset every env (one room generation per group; members are copies) and start a new cache."""
        first_seed = self.next_seed(seed)
        group_template: dict[int, Any] = {}
        for entry in self.entries:
            entry.seed = first_seed + entry.group_id
            if entry.group_id not in group_template:
                entry.env.reset(seed=entry.seed, mode=self.split)
                group_template[entry.group_id] = entry.env
            else:
                entry.env = copy.deepcopy(group_template[entry.group_id])
            entry.num_actions, entry.terminated, entry.truncated = 0, False, False
            entry.rewards, entry.infos = [], []
        self.cache = [
            EnvCache(e.env_id, e.group_id, e.tag, e.seed, penalty=0.0,
                     history=[as_entry(Observation(e.env.render(), e.max_actions_per_traj))])
            for e in self.entries
        ]
        return self.cache

    def action_space(self, env_id: int) -> list[str]:
        return list(self.entries[env_id].env.get_all_actions())

    def env_snapshot(self, env_id: int) -> Any:
        """A copy of env `env_id` in its current state (for expert generators: stepping it changes nothing here)."""
        return copy.deepcopy(self.entries[env_id].env)

    def done(self, env_id: int) -> bool:
        """Whether env `env_id`'s episode has ended."""
        return self.entries[env_id].terminated

    def step(self, env_inputs: list[EnvInput]) -> list[EnvCache]:
        """Execute each env's parsed actions (spec §5.4); returns the cache entries still active."""
        for env_input in env_inputs:
            entry = self.entries[env_input.env_id]
            if entry.terminated:
                raise ValueError(f"env {entry.env_id} is done and cannot be stepped")
            self._step_one(entry, env_input)
        return [self.cache[e.env_id] for e in self.entries if not e.terminated]

    def _step_one(self, entry: EnvEntry, env_input: EnvInput) -> None:
        cache = self.cache[entry.env_id]
        valid = self._valid_actions(entry.env, env_input.actions)
        actions_left = entry.max_actions_per_traj - entry.num_actions
        reward, info, done, executed = 0.0, {}, False, []
        for name, action in valid[:actions_left]:
            _, step_reward, done, step_info = entry.env.step(action)
            reward += step_reward
            info.update(step_info)
            executed.append(name)
            if done:
                break
        if not env_input.format_ok or not valid or len(valid) != len(env_input.actions):
            cache.penalty += self.format_penalty
        entry.num_actions += len(executed)
        entry.rewards.append(reward)
        entry.infos.append(info)
        if done:
            entry.terminated, entry.truncated = True, not info.get("success", False)
        elif entry.num_actions >= entry.max_actions_per_traj:
            entry.terminated, entry.truncated = True, True
        shown = read_entry(cache.history[-1])
        cache.history[-1].update(as_entry(Turn(
            shown.state, shown.actions_left, actions=executed, reward=reward, info=info,
            llm_response=env_input.llm_response, llm_raw_response=env_input.llm_raw_response,
            parsed=env_input.parsed, response_ids=env_input.response_ids,
        )))
        cache.history.append(
            as_entry(Observation(entry.env.render(), entry.max_actions_per_traj - entry.num_actions))
        )

    @staticmethod
    def _valid_actions(env, actions: list[str]) -> list[tuple[str, Any]]:
        """(name, env action) pairs for the names the env knows, in order; unknown names are dropped."""
        ids_by_name = _action_ids_by_name(env)
        if ids_by_name is None:
            return [(a, a) for a in actions]
        return [(a, ids_by_name[a.lower()]) for a in actions if a.lower() in ids_by_name]

    # --- results ----------------------------------------------------------------------------------
    def get_rollout_states(self) -> list[EnvRecord]:
        """The finished record of every env: its cache with its `metrics` (spec §5.5), `<Tag>/pass@<group_size>`
        included."""
        group_success: dict[tuple[str, int], bool] = {}
        for entry in self.entries:
            key = (entry.tag, entry.group_id)
            group_success[key] = group_success.get(key, False) or self._success(entry)
        return [EnvRecord.finished(cache, self._env_metrics(entry, group_success[(entry.tag, entry.group_id)]))
                for entry, cache in zip(self.entries, self.cache)]

    @staticmethod
    def _success(entry: EnvEntry) -> bool:
        return entry.terminated and not entry.truncated

    def _env_metrics(self, entry: EnvEntry, group_any_success: bool) -> dict[str, float]:
        tag, turns = entry.tag, max(len(entry.infos), 1)
        metrics = {
            f"{tag}/success": float(self._success(entry)),
            f"{tag}/num_actions": float(entry.num_actions),
            f"{tag}/pass@{self.group_size}": float(group_any_success),
        }
        keys = sorted({k for info in entry.infos for k in info if k != "success"})
        for key in keys:
            metrics[f"{tag}/{key}"] = sum(float(info.get(key, 0.0)) for info in entry.infos) / turns
        return metrics

"""ContextManager: prompts, response parsing, training tensors, scores and metrics (spec §6).

Text and tensors only. The per-turn message layout follows spec §6.2. Assistant turns are carried as the
tokens the model sampled (see chat_tokens.py): the context the model saw while generating and the sequence
the trainer scores are the same ids.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import numpy as np
import torch

from SPA_agent.envs import REGISTRY
from SPA_agent.rollout.chat_tokens import SAMPLED, SYSTEM, AssistantTurn, ChatTokenizer
from SPA_agent.rollout.es_manager import EnvInput
from SPA_agent.rollout.parsing import MODES, parse_response, response_format
from SPA_agent.rollout.rewards import normalize_scores, turn_ends
from SPA_agent.rollout.turns import EnvCache, EnvRecord, Turn, read_entry, turns

SYSTEM_PROMPT = "You're a helpful assistant. "


class ContextManager:
    def __init__(self, config: Mapping, tokenizer):
        self.config = config
        # The one road of the prompt mode: `ctx_manager.mode` of the config, which each entry point sets once from
        # its own key (data_gen.prompt_mode, evaluation.prompt_mode; PPO's own ctx_manager.mode).
        self.mode = config["ctx_manager"]["mode"]
        if self.mode not in MODES:
            raise ValueError(f"ctx_manager.mode must be one of {MODES}, got {self.mode!r}")
        proxy_cfg = config["agent_proxy"]
        self.action_sep = proxy_cfg["action_sep"]
        self.max_actions_per_turn = int(proxy_cfg["max_actions_per_turn"])
        self.enable_think = bool(proxy_cfg["enable_think"])
        self.use_turn_scores = bool(proxy_cfg["use_turn_scores"])
        self.normalization = proxy_cfg["reward_normalization"]
        self.enable_response_mask = bool(config["enable_response_mask"])
        self.tokenizer = tokenizer
        self.chat = ChatTokenizer(tokenizer)
        self.prefix = "<think>" if self.enable_think else "<answer>"
        self.format = response_format(self.mode, self.enable_think)
        self._instructions: dict[str, str] = {}
        self._max_tokens: dict[str, object] = {}  # custom_envs.<tag>.max_tokens, read once (OmegaConf is slow)

    # --- prompts ------------------------------------------------------------------------------------
    def instruction(self, tag: str) -> str:
        """The first user message for env `tag` (spec §6.1)."""
        if tag not in self._instructions:
            self._instructions[tag] = self._build_instruction(tag)
        return self._instructions[tag]

    def _build_instruction(self, tag: str) -> str:
        env_cfg = self.config["custom_envs"][tag]
        key = "env_instruction_add_worldmodel" if self.mode == "add_worldmodel" else "env_instruction"
        if not env_cfg.get(key):
            raise ValueError(f"custom_envs.{tag} has no {key}: the prompt would be empty")
        text = env_cfg[key]
        _, config_cls = REGISTRY[env_cfg["env_type"]]
        env_config = config_cls(**dict(env_cfg.get("env_config") or {}))
        grid_vocab = getattr(env_config, "grid_vocab", None)
        if grid_vocab:
            meanings = ", ".join(f"{symbol}: {meaning}" for symbol, meaning in grid_vocab.items())
            text += f"\nThe meaning of each symbol in the state is:\n{meanings}"
        action_lookup = getattr(env_config, "action_lookup", None)
        if action_lookup:
            names = ", ".join(action_lookup.values())
            text += (
                f"\nYour available actions are:\n{names}\nYou can make up to "
                f"{env_cfg['max_actions_per_traj']} actions, separated by the action separator \" "
                f"{self.action_sep} \"\n"
            )
        return text

    def messages(self, cache: EnvCache | EnvRecord, normalized: bool = True, for_update: bool = False) -> list[dict]:
        """Chat messages of one trajectory, running or finished (spec §6.2). Assistant contents are the normalized
        responses (`normalized=True`, the view written to SFT data) or the raw ones the model actually produced."""
        if cache.tag not in self._max_tokens:
            self._max_tokens[cache.tag] = self.config["custom_envs"][cache.tag].get("max_tokens", 100)
        max_tokens = self._max_tokens[cache.tag]
        history = [read_entry(entry) for entry in cache.history]
        if for_update and not isinstance(history[-1], Turn):
            history = history[:-1]
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": self.instruction(cache.tag)}]
        for idx, entry in enumerate(history):
            messages[-1]["content"] += (
                f"\nTurn {idx + 1}:\nState:\n{entry.state}\nYou have {entry.actions_left} actions left. "
                f"Always output: {self.format} with no extra text. Strictly follow this format. "
                f"Max response length: {max_tokens} words (tokens).\n"
            )
            if isinstance(entry, Turn):
                content = entry.llm_response if normalized else entry.llm_raw_response
                messages.append({"role": "assistant", "content": content})
                if not (for_update and idx == len(history) - 1):
                    messages.append({"role": "user", "content": f"Reward:\n{entry.reward}\n"})
        return messages

    def _assistant_turns(self, cache: EnvCache | EnvRecord) -> list[AssistantTurn]:
        return [AssistantTurn(self.prefix, turn.response_ids) for turn in turns(cache.history)]

    def get_lm_inputs(self, caches: list[EnvCache]) -> list[tuple[list[dict], list[int]]]:
        """(messages, prompt ids) for the next turn of each env; the ids end with the forced prefix."""
        conversations = [(self.messages(cache, normalized=False), self._assistant_turns(cache), self.prefix)
                         for cache in caches]
        return [(messages, ids) for (messages, _, _), (ids, _) in zip(conversations, self.chat.build_many(conversations))]

    # --- responses ----------------------------------------------------------------------------------
    def get_env_inputs(self, caches: list[EnvCache], texts: list[str], ids: list[list[int] | None],
                       finished: list[bool]) -> list[EnvInput]:
        """Parse each generated continuation (forced prefix prepended) into an EnvInput (spec §6.4).
        Generators without token ids (api, random) get their text tokenized, plus end-of-turn if finished."""
        env_inputs = []
        for cache, text, token_ids, done in zip(caches, texts, ids, finished):
            if token_ids is None:
                token_ids = self.chat.encode(text) + ([self.chat.stop_ids[0]] if done else [])
            raw = self.prefix + text
            parsed = parse_response(raw, self.mode, self.action_sep, self.max_actions_per_turn, self.enable_think)
            env_inputs.append(EnvInput(
                env_id=cache.env_id, actions=parsed.actions, llm_response=parsed.normalized,
                llm_raw_response=raw, format_ok=parsed.format_ok, parsed=parsed.as_dict(),
                response_ids=list(token_ids),
            ))
        return env_inputs

    # --- training batch -----------------------------------------------------------------------------
    def get_masks_and_scores(self, records: list[EnvRecord]) -> dict[str, torch.Tensor]:
        """Left-padded tensors of every trajectory (docs/interfaces.md, "One rollout"); (B, T) and (B, T-1)."""
        rows = self.chat.build_many([(self.messages(r, normalized=False, for_update=True), self._assistant_turns(r), None)
                                     for r in records])
        T = max(len(ids) for ids, _ in rows)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # Filled as numpy arrays (one conversion per row from its list is several times faster than torch.tensor)
        ids_array = np.full((len(rows), T), pad_id, dtype=np.int64)
        roles_array = np.full((len(rows), T), -1, dtype=np.int64)
        for i, (ids, row_roles) in enumerate(rows):
            ids_array[i, T - len(ids):] = ids
            roles_array[i, T - len(ids):] = row_roles
        input_ids, roles = torch.from_numpy(ids_array), torch.from_numpy(roles_array)
        attention_mask = (roles >= 0).long()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        response_mask = (roles[:, 1:] == SAMPLED).float()
        after_system = (roles[:, 1:] > SYSTEM).float()
        loss_mask = response_mask if self.enable_response_mask else after_system
        scores = self._scores(records, roles, loss_mask)
        return {
            "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "responses": input_ids[:, 1:], "response_mask": response_mask, "loss_mask": loss_mask,
            "rm_scores": scores,
        }

    def _scores(self, records: list[EnvRecord], roles: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Token-level scores (B, T-1): the normalized, penalized return on the last loss-mask column, or
        with `use_turn_scores` each turn's reward on that turn's last sampled token (spec §6.5–§6.6)."""
        scores = torch.zeros_like(loss_mask)
        if self.use_turn_scores:
            for i, record in enumerate(records):
                rewards = [turn.reward for turn in turns(record.history)]
                ends = turn_ends(roles[i : i + 1, 1:] == SAMPLED)[0].nonzero().flatten().tolist()
                for reward, end in zip(rewards, ends):
                    scores[i, end] = float(reward)
                if ends:
                    scores[i, ends[-1]] += record.penalty
            return scores
        returns = torch.tensor([sum(turn.reward for turn in turns(r.history)) + r.penalty for r in records])
        normalized = normalize_scores(returns, self._group_keys(records), self.normalization["method"])
        last = (loss_mask.shape[1] - 1) - loss_mask.flip(-1).argmax(-1)
        scores[torch.arange(len(records)), last] = normalized.to(scores.dtype)
        return scores

    def _group_keys(self, records: list[EnvRecord]) -> list:
        grouping = self.normalization["grouping"]
        if grouping == "state":
            return [r.group_id for r in records]
        if grouping == "inductive":
            return [r.tag for r in records]
        if grouping == "batch":
            return [0] * len(records)
        raise ValueError(f"reward_normalization.grouping must be state, inductive or batch, got {grouping!r}")

    def formulate_rollouts(self, records: list[EnvRecord]) -> tuple[dict, dict, dict]:
        """(tensors, non-tensors, metrics) of a finished rollout."""
        tensors = self.get_masks_and_scores(records)
        non_tensors = {
            "env_ids": np.array([r.env_id for r in records]),
            "group_ids": np.array([r.group_id for r in records]),
            "tags": object_array([r.tag for r in records]),
            "seeds": np.array([r.seed for r in records]),
            "messages_list": object_array([self.messages(r) for r in records]),
            "turn_states": object_array([turn_states(r) for r in records]),
            "turn_rewards": object_array([turn_rewards(r) for r in records]),
        }
        metrics = aggregate_metrics([r.metrics for r in records])
        metrics["response_length"] = float(tensors["response_mask"].sum(-1).mean())
        return tensors, non_tensors, metrics


def turn_states(record: EnvRecord) -> list[str]:
    """The environment's render before each turn the model took (GiGPO's anchor states)."""
    return [turn.state for turn in turns(record.history)]


def turn_rewards(record: EnvRecord) -> list[float]:
    """The environment reward of each turn the model took, the format penalty added to the last one."""
    rewards = [float(turn.reward) for turn in turns(record.history)]
    if rewards:
        rewards[-1] += record.penalty
    return rewards


def object_array(items: list) -> np.ndarray:
    """1-D object array holding `items` as they are (numpy would turn equal-length lists into 2-D)."""
    array = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        array[i] = item
    return array


def aggregate_metrics(per_env: list[Mapping[str, float]]) -> dict[str, float]:
    """Mean of each `<Tag>/<name>` over the envs that report it (spec §6.7)."""
    values: dict[str, list[float]] = defaultdict(list)
    for metrics in per_env:
        for key, value in metrics.items():
            values[key].append(float(value))
    return {key: float(np.mean(v)) for key, v in values.items()}

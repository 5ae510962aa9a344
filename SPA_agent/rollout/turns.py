"""The rollout's records: one per env (`EnvCache` while the rollout runs, `EnvRecord` once it is finished) and
typed views of the env's history entries (`Observation`, `Turn`); docs/interfaces.md, "One rollout".

The env-state manager owns one `EnvCache` per env and updates it every turn (the format penalty, the history); the
context manager reads it to build the next prompt. When the rollout's states are collected
(`EnvStateManager.get_rollout_states`) each cache becomes a frozen `EnvRecord` with the env's metrics: what
`Rollout.states` holds and every later reader (trainer, self-play, evaluation) takes.

The history itself stays a list of plain dicts: the env-state manager writes them and they are what callers
hold and copy. Readers go through `read_entry` instead of testing for keys: an entry is either an
`Observation` (the render the model is shown, before it answers) or a `Turn` (that observation plus what the
model answered and what its actions did). Every entry but the last of a finished history is a Turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Observation:
    """A history entry the model has not answered yet: the render it is shown and the actions it has left."""

    state: str
    actions_left: int


@dataclass(frozen=True)
class Turn(Observation):
    """A turn the model took: the observation it answered, its response and the env's outcome.

    The fields share the entry's objects (no copies), so a Turn reads the rollout exactly as recorded.
    """

    actions: list[str]  # the action names the env executed (unknown names dropped, cut at actions_left)
    reward: float  # the env reward summed over those actions
    info: dict  # the env's step infos merged
    llm_response: str  # the normalized response (the text written to SFT data)
    llm_raw_response: str  # what the model produced, forced prefix included
    parsed: dict  # parsing.ParsedResponse.as_dict(): think, answer, observation, prediction, format_ok
    response_ids: list[int] | None  # the sampled token ids, end-of-turn included when emitted

    @property
    def format_ok(self) -> bool:
        return bool(self.parsed["format_ok"])


_FIELD_NAMES = {cls: tuple(f.name for f in fields(cls)) for cls in (Observation, Turn)}
"""Field names of each entry type, in order (read once: `dataclasses.fields` is slow in the rollout's loops)."""


def read_entry(entry: Mapping) -> Observation | Turn:
    """The typed view of one history entry; a Turn once the model's response is recorded in it."""
    if "llm_response" in entry:
        return Turn(*[entry[name] for name in _FIELD_NAMES[Turn]])
    return Observation(entry["state"], entry["actions_left"])


def as_entry(record: Observation | Turn) -> dict:
    """The history dict of `record` (the keys `read_entry` reads, in field order)."""
    names = _FIELD_NAMES.get(type(record))
    if names is None:
        names = tuple(f.name for f in fields(record))
    return {name: getattr(record, name) for name in names}


def turns(history: Iterable[Mapping]) -> list[Turn]:
    """The turns the model took, in order."""
    return [entry for entry in map(read_entry, history) if isinstance(entry, Turn)]


def rendered_states(history: Iterable[Mapping]) -> list[str]:
    """Every render of the trajectory, the initial one to the last."""
    return [read_entry(entry).state for entry in history]


def transitions(history: Sequence[Mapping]) -> list[tuple[Turn, str]]:
    """Each turn with the render after it: `history[t]["state"]` / `history[t+1]["state"]` bracket turn t."""
    entries = [read_entry(entry) for entry in history]
    return [(entry, after.state) for entry, after in zip(entries, entries[1:]) if isinstance(entry, Turn)]


@dataclass
class EnvCache:
    """One env's rollout while it runs: the env-state manager's cache entry, updated every turn."""

    env_id: int
    group_id: int  # envs of one group start from the same puzzle (spec §5.2)
    tag: str  # the env's entry in custom_envs, e.g. "SimpleSokoban"
    seed: int  # the seed the env was reset with
    penalty: float  # the format penalty summed over the turns so far (spec §5.4)
    history: list[dict]  # the entries so far (read with read_entry), the latest observation last


@dataclass(frozen=True)
class EnvRecord:
    """One env's finished rollout (`Rollout.states[i]`, spec §5.3), built once from its `EnvCache`.

    The history is the cache's list of entries, not a copy; the env-state manager starts new ones at reset, so
    nothing changes them once the record is built.
    """

    env_id: int
    group_id: int
    tag: str
    seed: int
    penalty: float  # the format penalty of the whole trajectory
    metrics: dict[str, float]  # `<Tag>/<name>` of this env (spec §5.5), `<Tag>/pass@<group_size>` included
    history: list[dict]  # every entry: the turns taken, then the final observation

    @classmethod
    def finished(cls, cache: EnvCache, metrics: dict[str, float]) -> EnvRecord:
        """The record of `cache` once its rollout is over."""
        return cls(cache.env_id, cache.group_id, cache.tag, cache.seed, cache.penalty, metrics, cache.history)

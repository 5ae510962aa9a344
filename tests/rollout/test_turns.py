"""The typed rollout records (SPA_agent/rollout/turns.py) read what the real EnvStateManager writes."""

import copy
import dataclasses

import pytest

from SPA_agent.rollout.es_manager import EnvInput, EnvStateManager
from SPA_agent.rollout.turns import (
    EnvRecord,
    Observation,
    Turn,
    as_entry,
    read_entry,
    rendered_states,
    transitions,
    turns,
)

#: two turns per env: env 0 writes a name Sokoban does not know (dropped), env 1 two known moves
SCRIPT = {0: (["Up", "Jump"], ["Left"]), 1: (["Down", "Right"], ["Up"])}


def _env_input(env_id: int, turn: int, actions: list[str]) -> EnvInput:
    text = f"<think>turn {turn}</think><answer>{' || '.join(actions)}</answer>"
    return EnvInput(env_id=env_id, actions=actions, llm_response=text, llm_raw_response=text + " ",
                    format_ok=env_id == 1, parsed={"answer": actions, "format_ok": env_id == 1},
                    response_ids=[env_id, turn, 7])


@pytest.fixture
def played(tiny_config):
    """A manager whose envs 0 and 1 (one group) took the two SCRIPT turns; the renders before each turn and the
    inputs given, per env."""
    cfg = tiny_config("_2_sokoban", "es_manager.train.env_groups=1", "es_manager.train.env_configs.n_groups=[1]")
    es = EnvStateManager(cfg, "train")
    es.reset(seed=3)
    before, given = {0: [], 1: []}, {0: [], 1: []}
    for turn in range(2):
        inputs = [_env_input(env_id, turn, SCRIPT[env_id][turn]) for env_id in SCRIPT]
        for env_input in inputs:
            before[env_input.env_id].append(es.entries[env_input.env_id].env.render())
            given[env_input.env_id].append(env_input)
        es.step(inputs)
    return es, before, given


def test_a_real_history_reads_as_its_turns_with_the_exact_fields(played):
    es, before, given = played
    for env_id in SCRIPT:
        cache, entry = es.cache[env_id], es.entries[env_id]
        taken = turns(cache.history)
        assert len(taken) == 2 == len(cache.history) - 1
        actions_left = entry.max_actions_per_traj
        for t, (turn, env_input) in enumerate(zip(taken, given[env_id])):
            known = [a for a in env_input.actions if a != "Jump"]
            assert turn == Turn(
                state=before[env_id][t], actions_left=actions_left, actions=known, reward=entry.rewards[t],
                info=entry.infos[t], llm_response=env_input.llm_response,
                llm_raw_response=env_input.llm_raw_response, parsed=env_input.parsed,
                response_ids=env_input.response_ids,
            )
            assert turn.format_ok is (env_id == 1)
            actions_left -= len(known)
        final = read_entry(cache.history[-1])
        assert type(final) is Observation
        assert final == Observation(entry.env.render(), entry.max_actions_per_traj - entry.num_actions)


def test_records_share_the_entry_objects_and_round_trip_to_the_same_dicts(played):
    es, _, _ = played
    for env_id in SCRIPT:
        history = es.cache[env_id].history
        assert [as_entry(read_entry(entry)) for entry in history] == history
        assert [list(as_entry(read_entry(entry))) for entry in history] == [list(entry) for entry in history]
        for turn, entry in zip(turns(history), history):
            assert turn.response_ids is entry["response_ids"] and turn.parsed is entry["parsed"]


def test_observation_only_entries_are_not_turns(tiny_config):
    es = EnvStateManager(tiny_config("_2_sokoban"), "train")
    history = es.reset(seed=3)[0].history
    assert len(history) == 1 and type(read_entry(history[0])) is Observation
    assert turns(history) == [] and transitions(history) == []
    assert rendered_states(history) == [es.entries[0].env.render()]


def test_transitions_bracket_each_turn_with_the_next_render(played):
    es, before, _ = played
    for env_id in SCRIPT:
        history = es.cache[env_id].history
        pairs = transitions(history)
        assert [turn for turn, _ in pairs] == turns(history)
        assert [after for _, after in pairs] == [*before[env_id][1:], es.entries[env_id].env.render()]
        assert rendered_states(history) == [*before[env_id], es.entries[env_id].env.render()]


def test_a_half_written_turn_is_an_error_not_an_observation():
    with pytest.raises(KeyError, match="actions"):
        read_entry({"state": "#P", "actions_left": 10, "llm_response": "<answer>Up</answer>"})


def test_rollout_states_are_frozen_records_of_the_caches_with_their_metrics(played):
    es, _, _ = played
    records = es.get_rollout_states()
    assert all(type(record) is EnvRecord for record in records)
    for cache, record in zip(es.cache, records):
        assert (record.env_id, record.group_id, record.tag, record.seed, record.penalty) == (
            cache.env_id, cache.group_id, cache.tag, cache.seed, cache.penalty)
        assert record.history is cache.history  # the entries as written, not a copy
        assert record.metrics["SimpleSokoban/num_actions"] == es.entries[record.env_id].num_actions
    assert [record.penalty for record in records] == pytest.approx([2 * es.format_penalty, 0.0])  # env 0: bad format
    with pytest.raises(dataclasses.FrozenInstanceError):
        records[0].penalty = 0.0


def test_a_reset_leaves_the_records_of_the_last_rollout_as_they_were(played):
    es, _, _ = played
    records = es.get_rollout_states()
    before = copy.deepcopy([record.history for record in records])
    es.reset(seed=4)
    assert [record.history for record in records] == before
    assert all(len(cache.history) == 1 for cache in es.cache)

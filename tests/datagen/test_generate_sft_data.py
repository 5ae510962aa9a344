"""Stage 1 end to end on the tiny config: ground-truth substitution checked by replaying every trajectory in a
fresh env, trajectory-level split, schema, determinism, resume and the data card."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from SPA_agent.config import compose
from SPA_agent.envs import make_env
from SPA_agent.selfplay.generate import (
    CARD_FILE,
    DATA_FILES,
    PARTIAL_DIR,
    SFT_SCHEMA,
    generate,
    prepare_data_gen_config,
    split_rows,
    substitute_trajectory,
)
from SPA_agent.selfplay.worldmodel import extract_states

ENV_CONFIGS = {"_2_sokoban": "sokoban", "_3_frozen_lake": "frozen_lake", "_10_sudoku": "sudoku"}
#: data.max_length of stage 2 for the tiny and small presets (sft/finetune_ft.sh, from SPA_agent/model_presets.py)
TINY_SFT_MAX_LENGTH = 4096


def data_gen_config(config_name, out_dir, *overrides, num_batches=2):
    cfg = compose(config_name, ["model=tiny", *overrides])
    cfg = prepare_data_gen_config(cfg, config_name)
    OmegaConf.update(cfg, "data_gen.num_batches", num_batches)
    OmegaConf.update(cfg, "data_gen.output_dir", str(out_dir))
    return cfg


def read_rows(out_dir):
    return {name: pq.read_table(out_dir / name).to_pylist() for name in DATA_FILES}


def replay_states(cfg, tag, seed, turn_actions):
    """Renders before turn 0 and after each turn, replaying the executed actions in a fresh env."""
    env_cfg = cfg.custom_envs[tag]
    env = make_env(env_cfg.env_type, OmegaConf.to_container(env_cfg.env_config, resolve=True) if env_cfg.env_config else None)
    states = [env.reset(seed=seed, mode="train")]
    for actions in turn_actions:
        for action in actions:
            env.step(action)
        states.append(env.render())
    return states


def check_substitution_by_replay(cfg, out_dir, require_states=True):
    trajectories = {t["trajectory_id"]: t for t in map(json.loads, (out_dir / "raw_trajectories.jsonl").open())}
    rows = [r for split in read_rows(out_dir).values() for r in split]
    checked = 0
    for row in rows:
        traj = trajectories[row["trajectory_id"]]
        states = replay_states(cfg, row["env_tag"], row["seed"], traj["actions"])
        observations, predictions = extract_states(row["response"])
        assert all(o == states[row["turn"]] for o in observations)
        assert all(p == states[row["turn"] + 1] for p in predictions)
        # Earlier assistant turns inside the prompt carry the corrected states too.
        earlier = [m["content"] for m in row["prompt"] if m["role"] == "assistant"]
        for t, content in enumerate(earlier):
            obs, pred = extract_states(content)
            assert all(o == states[t] for o in obs) and all(p == states[t + 1] for p in pred)
        checked += bool(observations and predictions)
    assert checked > 0 or not require_states


@pytest.mark.slow
@pytest.mark.parametrize("config_name", sorted(ENV_CONFIGS))
def test_random_generator_end_to_end(config_name, tmp_path, tiny_tokenizer):
    cfg = data_gen_config(config_name, tmp_path / "data", "generator=random")
    card = generate(cfg)
    out = tmp_path / "data"
    rows = read_rows(out)
    for name in DATA_FILES:
        assert pq.read_schema(out / name).equals(SFT_SCHEMA)
    train_ids = {r["trajectory_id"] for r in rows["wm_train.parquet"]}
    val_ids = {r["trajectory_id"] for r in rows["wm_val.parquet"]}
    assert train_ids and val_ids and not train_ids & val_ids
    assert {r["data_source"] for split in rows.values() for r in split} == {ENV_CONFIGS[config_name]}
    check_substitution_by_replay(cfg, out)
    assert card["num_trajectories"] == 2 * 4 * 2 and card["num_rows"] == sum(map(len, rows.values()))
    assert card["seeds"] == {"first": 10000, "last": 10007, "distinct_puzzles": 8}
    assert json.loads((out / CARD_FILE).read_text())["num_rows"] == card["num_rows"]
    assert not (out / PARTIAL_DIR).exists() and (out / "config.yaml").is_file()
    # stage 2 keeps every row whole at the SFT length sft/finetune_ft.sh gives the embedded tokenizer (5-turn
    # Sudoku rows are the longest)
    from sft.spa_sft_dataset import SpaSftDataset

    for name in DATA_FILES:
        data = SpaSftDataset(str(out / name), tiny_tokenizer, max_length=TINY_SFT_MAX_LENGTH)
        assert data.truncation_report.as_dict()["rows_truncated"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("generator", ["random", "hf"])
def test_same_config_gives_byte_identical_parquet(generator, tmp_path):
    outputs = []
    for run in range(2):
        cfg = data_gen_config("_3_frozen_lake", tmp_path / str(run), f"generator={generator}",
                              "actor_rollout_ref.rollout.response_length=8", "agent_proxy.max_turn=2",
                              "es_manager.train.env_groups=1", "es_manager.train.group_size=2",
                              "es_manager.train.env_configs.n_groups=[1]", "data_gen.format_filter=false",
                              num_batches=1)
        cfg.data_gen.output_dir = str(tmp_path / "same")  # same config, fresh run each time
        generate(cfg)
        outputs.append({name: (tmp_path / "same" / name).read_bytes() for name in (*DATA_FILES, CARD_FILE)})
    assert outputs[0] == outputs[1]
    check_substitution_by_replay(cfg, tmp_path / "same", require_states=generator == "random")


class Interrupt(Exception):
    pass


def test_interrupted_run_leaves_no_complete_looking_output_and_resumes(tmp_path, monkeypatch):
    from SPA_agent.rollout.agent_proxy import LLMAgentProxy

    out = tmp_path / "data"
    cfg = data_gen_config("_2_sokoban", out, "generator=random", num_batches=2)
    real_rollout, calls = LLMAgentProxy.rollout, []

    def rollout_then_interrupt(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Interrupt  # the process dies during the second batch
        return real_rollout(self, *args, **kwargs)

    monkeypatch.setattr(LLMAgentProxy, "rollout", rollout_then_interrupt)
    with pytest.raises(Interrupt):
        generate(cfg)
    assert not any((out / name).exists() for name in (*DATA_FILES, CARD_FILE))
    assert (out / PARTIAL_DIR / "batch_00000.json").is_file()
    first_batch = json.loads((out / PARTIAL_DIR / "batch_00000.json").read_text())["rows"]

    monkeypatch.setattr(LLMAgentProxy, "rollout", real_rollout)
    card = generate(cfg)
    rows = [r for split in read_rows(out).values() for r in split]
    assert card["seeds"] == {"first": 10000, "last": 10007, "distinct_puzzles": 8}
    kept = {(r["trajectory_id"], r["turn"]): r["response"] for r in rows}
    assert all(kept[(r["trajectory_id"], r["turn"])] == r["response"] for r in first_batch)


def test_substitute_trajectory_corrects_every_assistant_turn_and_counts_untagged():
    messages = [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "S0"},
        {"role": "assistant", "content": "<think><observation>?</observation>x<prediction>?</prediction></think>"},
        {"role": "user", "content": "S1"}, {"role": "assistant", "content": "<think>no tags</think>"},
        {"role": "user", "content": "S2"},
        {"role": "assistant", "content": "<observation>a</observation><observation>b</observation>"},
    ]
    out, tagged = substitute_trajectory(messages, ["s0", "s1\\g<0>", "s2", "s3"])
    assert out[2]["content"] == "<think><observation>s0</observation>x<prediction>s1\\g<0></prediction></think>"
    assert out[4]["content"] == "<think>no tags</think>"
    assert out[6]["content"] == "<observation>s2</observation><observation>s2</observation>"
    assert tagged == [True, False, True] and messages[2]["content"].count("?") == 2  # input untouched


def test_split_by_trajectory_and_original_row_split():
    rows = [{"trajectory_id": t, "turn": k} for t in range(10) for k in range(3)]
    train, val = split_rows(rows, "trajectory", 0.2, 42)
    assert len({r["trajectory_id"] for r in val}) == 2 and len(train) + len(val) == 30
    assert not {r["trajectory_id"] for r in train} & {r["trajectory_id"] for r in val}
    assert split_rows(rows, "trajectory", 0.2, 42) == (train, val)
    train, val = split_rows(rows, "row", 0.2, 42)
    assert (len(train), len(val)) == (24, 6)  # sklearn: n_test = ceil(0.2 · 30)
    with pytest.raises(ValueError, match="split_by"):
        split_rows(rows, "puzzle", 0.2, 42)


def test_schema_matches_docs():
    assert SFT_SCHEMA.field("prompt").type.value_type == pa.struct([("content", pa.string()), ("role", pa.string())])
    assert SFT_SCHEMA.names[:6] == ["prompt", "response", "data_source", "ability", "reward_model", "extra_info"]


@pytest.mark.slow
def test_cli_default_output_dir_and_usage_error(tmp_path, monkeypatch, capsys, call_entry):
    """The command line's run and usage error, in this process (the run_spa.sh test starts the entry point as a
    process)."""
    from SPA_agent import generate_sft_data

    argv = ["--config-name", "_3_frozen_lake", "model=tiny", "generator=random", "data_gen.num_batches=1"]
    monkeypatch.setattr(sys, "argv", [generate_sft_data.__name__, *argv, f"output_root={tmp_path}"])
    generate_sft_data.main()
    out = tmp_path / "sftdata" / "_3_frozen_lake-tiny-text_with_coordinates"
    assert f"data written to {out}" in capsys.readouterr().out
    assert all((out / name).is_file() for name in (*DATA_FILES, CARD_FILE, "config.yaml", "data_card.md"))
    assert OmegaConf.load(out / "config.yaml").ctx_manager.mode == "add_worldmodel"
    code, err = call_entry(generate_sft_data, [*argv[:-1], "data_gen.num_batches=0"])
    assert code == 2 and "num_batches" in err and err.startswith("error: ") and err.count("\n") == 1

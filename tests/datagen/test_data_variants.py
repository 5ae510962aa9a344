"""Data-side ablations of stage 1: self-belief rows (no substitution), random coordinates, the format filter
that the FrozenLake and Sudoku entry configs apply by default (spec §2.1), and the rows without world model (the
control arm of issue 13)."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from SPA_agent.config import compose
from SPA_agent.selfplay.data_variants import randomize_coordinates, strip_worldmodel, without_worldmodel_row
from SPA_agent.selfplay.generate import DATA_FILES, format_filtered, generate, prepare_data_gen_config
from SPA_agent.selfplay.worldmodel import extract_states, parse_state

SMALL = ("es_manager.train.env_groups=2", "es_manager.train.group_size=2", "es_manager.train.env_configs.n_groups=[2]",
         "agent_proxy.max_turn=2")
SOKOBAN = ("#######\n#__O__#\n#__X__#\n#__P__#\n#######\n"
           "Player (P) is at (3,3); box (X) is at (2,3); target (O) is at (1,3).")
SUDOKU = "| 1 . 3 4 | 3 4 1 2 | 2 1 4 3 | 4 3 . 1 \nEmpty positions to be filled are at (1,2), (4,3)."
PAIR = re.compile(r"\((\d+),(\d+)\)")


def data_gen_config(config_name, out_dir, *overrides, num_batches=1):
    cfg = compose(config_name, ["model=tiny", f"data_gen.num_batches={num_batches}", f"data_gen.output_dir={out_dir}",
                                *overrides])
    return prepare_data_gen_config(cfg, config_name)


def _rows(out):
    return [row for name in DATA_FILES for row in pq.read_table(out / name).to_pylist()]


@pytest.mark.parametrize("state, low, rows, cols", [(SOKOBAN, 0, 5, 7), (SUDOKU, 1, 4, 4)])
def test_random_coordinates_keep_the_grid_and_draw_cells_of_it(state, low, rows, cols):
    rng = np.random.default_rng(0)
    draws = [randomize_coordinates(state, rng) for _ in range(200)]
    true = parse_state(state)
    pairs = []
    for draw in draws:
        assert parse_state(draw).cells == true.cells
        assert PAIR.sub("(r,c)", draw) == PAIR.sub("(r,c)", state)  # same sentence, other numbers
        pairs += [(int(r), int(c)) for r, c in PAIR.findall(draw.split("\n")[-1])]
    assert {r for r, _ in pairs} == set(range(low, low + rows)) and {c for _, c in pairs} == set(range(low, low + cols))
    assert randomize_coordinates("_P__\n_O__", rng) == "_P__\n_O__"  # plain render: nothing to randomize


def test_format_filter_keeps_worldmodel_responses_only():
    good = "<think> <observation>s</observation> go <prediction>t</prediction></think><answer>Up</answer>"
    rows = [{"response": good}, {"response": "<think>no states</think><answer>Up</answer>"},
            {"response": "<answer>Up</answer><think><observation>s</observation><prediction>t</prediction></think>"}]
    assert format_filtered(rows) == rows[:1]


def test_format_filter_is_on_where_the_released_data_was_filtered():
    assert {name: compose(name, ["model=tiny"]).data_gen.format_filter
            for name in ("_2_sokoban", "_3_frozen_lake", "_10_sudoku")} == {
        "_2_sokoban": False, "_3_frozen_lake": True, "_10_sudoku": True}


@pytest.mark.slow
def test_format_filter_drops_untagged_turns_and_is_recorded_in_the_card(tmp_path):
    """The tiny model's sampled text is almost never in the world-model format: filtered, nothing is left (a
    one-line error); unfiltered, every row is kept and the card says so."""
    small = (*SMALL, "actor_rollout_ref.rollout.response_length=4", "agent_proxy.max_turn=1")
    with pytest.raises(ValueError, match="format filter kept no training row"):
        generate(data_gen_config("_3_frozen_lake", tmp_path / "f", "generator=hf", *small, num_batches=1))
    card = generate(data_gen_config("_3_frozen_lake", tmp_path / "u", "generator=hf", "data_gen.format_filter=false",
                                    *small, num_batches=1))
    assert card["format_filter"] is False and card["num_train"] + card["num_val"] == card["num_rows"] > 0
    card = generate(data_gen_config("_3_frozen_lake", tmp_path / "r", "generator=random", *SMALL, num_batches=1))
    assert card["format_filter"] is True and card["num_rows_before_format_filter"] == card["num_rows"]
    assert card["num_train"] + card["num_val"] == card["num_rows_passing_format_filter"]


@pytest.mark.slow
def test_self_belief_rows_keep_the_models_own_states(tmp_path):
    cfg = data_gen_config("_2_sokoban", tmp_path, "generator=random", "data_gen.state_targets=self_belief", *SMALL,
                          num_batches=1)
    card = generate(cfg)
    raw = {t["trajectory_id"]: t for t in map(json.loads, (tmp_path / "raw_trajectories.jsonl").open())}
    rows = _rows(tmp_path)
    for row in rows:
        assistant = [m["content"] for m in raw[row["trajectory_id"]]["messages"] if m["role"] == "assistant"]
        assert row["response"] == assistant[row["turn"]]  # untouched by substitution
    # The random generator copies the previous turn's blocks (empty on turn 0), never the true state.
    true_first = {t: r["true_states"][0] for t, r in raw.items()}
    assert all(extract_states(r["response"])[0] != [true_first[r["trajectory_id"]]] for r in rows if r["turn"] == 0)
    assert card["state_targets"] == "self_belief"


@pytest.mark.slow
def test_random_coordinate_rows_have_true_grids_and_random_coordinates(tmp_path):
    cfg = data_gen_config("_2_sokoban", tmp_path, "generator=random", "data_gen.state_targets=random_coordinates",
                          *SMALL, num_batches=1)
    generate(cfg)
    raw = {t["trajectory_id"]: t for t in map(json.loads, (tmp_path / "raw_trajectories.jsonl").open())}
    differs = 0
    for row in _rows(tmp_path):
        true = raw[row["trajectory_id"]]["true_states"][row["turn"]]
        (observation,), _ = extract_states(row["response"])
        assert parse_state(observation).cells == parse_state(true).cells
        assert PAIR.sub("", observation) == PAIR.sub("", true)
        differs += observation != true
    assert differs > 0


def test_strip_worldmodel_keeps_thoughts_and_answer_in_the_base_format():
    response = ("<think> <observation>#P#\nPlayer (P) is at (0,1).</observation> go left <prediction>P_#"
                "</prediction></think> <answer>Left || Up</answer>")
    assert strip_worldmodel(response) == "<think>go left</think><answer>Left || Up</answer>"
    # Not in the world-model format (no observation first): only the state blocks go.
    assert strip_worldmodel("<think>hm <prediction>x</prediction></think><answer>Up</answer>") == \
        "<think>hm </think><answer>Up</answer>"


@pytest.mark.parametrize("config_name, tag", [("_2_sokoban", "SimpleSokoban"), ("_3_frozen_lake", "FrozenLake")])
def test_rows_without_world_model_are_the_base_mode_rows_of_the_same_trajectories(tmp_path, config_name, tag):
    """The random generator draws the same actions in both prompt modes, so base-mode self-play on the same seeds
    plays the same trajectories: stripping the world-model rows must give exactly its rows."""
    rows = {}
    for mode in ("add_worldmodel", "base"):
        generate(data_gen_config(config_name, tmp_path / mode, "generator=random", f"data_gen.prompt_mode={mode}",
                                 "data_gen.format_filter=false", *SMALL))
        rows[mode] = _rows(tmp_path / mode)
    env = compose(config_name, ["model=tiny"]).custom_envs[tag]
    assert len(rows["base"]) == len(rows["add_worldmodel"]) > 4
    for wm_row, base_row in zip(rows["add_worldmodel"], rows["base"]):
        assert (wm_row["trajectory_id"], wm_row["turn"]) == (base_row["trajectory_id"], base_row["turn"])
        assert "<observation>" in wm_row["response"]
        prompt, response = without_worldmodel_row(wm_row["prompt"], wm_row["response"],
                                                  env.env_instruction_add_worldmodel, env.env_instruction)
        assert (prompt, response) == (base_row["prompt"], base_row["response"])
    with pytest.raises(ValueError, match="add_worldmodel instruction"):
        without_worldmodel_row(rows["base"][0]["prompt"], "", env.env_instruction_add_worldmodel, env.env_instruction)


def test_dataset_without_world_model_is_written_beside_its_source_and_passes_the_sft_checks(tmp_path, capsys):
    """python -m SPA_agent.selfplay.without_worldmodel: issue 43's format-only data (benchmarks/smollm2_sweep.sh
    START=nowm), every row of a stage-1 dataset in the base format, a card naming the source's, refused inputs in one
    line."""
    from SPA_agent.selfplay.data_card import check_dataset_complete, check_dataset_config
    from SPA_agent.selfplay.without_worldmodel import main

    source, target = tmp_path / "data", tmp_path / "data_nowm"
    generate(data_gen_config("_2_sokoban", source, "generator=random", *SMALL))
    assert main(["--config-name", "_2_sokoban", str(source), str(target), "model=tiny"]) == 0
    env = compose("_2_sokoban", ["model=tiny"]).custom_envs["SimpleSokoban"]
    for name in DATA_FILES:
        wm, nowm = (pq.read_table(d / name).to_pylist() for d in (source, target))
        assert len(wm) == len(nowm) > 0
        for a, b in zip(wm, nowm):
            assert (b["prompt"], b["response"]) == without_worldmodel_row(
                a["prompt"], a["response"], env.env_instruction_add_worldmodel, env.env_instruction)
            assert (a["trajectory_id"], a["turn"], a["seed"]) == (b["trajectory_id"], b["turn"], b["seed"])
            assert "<observation>" not in b["response"] and "<prediction>" not in b["response"]
        check_dataset_complete(target / name)  # what SFT checks before it trains
        check_dataset_config(target / name, "_2_sokoban")
    card = json.loads((target / "data_card.json").read_text())
    assert card["source_card"] == json.loads((source / "data_card.json").read_text())
    assert "data without world model written to" in capsys.readouterr().out

    (source / "data_card.json").unlink()
    assert main(["--config-name", "_2_sokoban", str(source), str(tmp_path / "other"), "model=tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "has no data_card.json" in err and err.count("\n") == 1
    assert main(["--config-name", "_2_sokoban", str(target), str(target), "model=tiny"]) == 2
    assert "the target" in capsys.readouterr().err

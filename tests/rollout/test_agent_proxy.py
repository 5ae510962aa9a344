"""End-to-end rollouts on the three envs, with the random generator and the tiny model."""

import pytest
import torch

from SPA_agent.generators import build_generator
from SPA_agent.rollout.agent_proxy import LLMAgentProxy

ENTRY_CONFIGS = ["_2_sokoban", "_3_frozen_lake", "_10_sudoku"]
TAGS = {"_2_sokoban": "SimpleSokoban", "_3_frozen_lake": "FrozenLake", "_10_sudoku": "Sudoku"}


def _proxy(cfg, tokenizer, tiny_dir):
    return LLMAgentProxy(cfg, build_generator(cfg.generator, str(tiny_dir), tokenizer), tokenizer)


@pytest.mark.parametrize("config_name", ENTRY_CONFIGS)
@pytest.mark.parametrize("mode", ["base", "add_worldmodel"])
def test_random_rollout_batch_satisfies_the_contract(config_name, mode, tiny_config, tiny_tokenizer, tiny_dir):
    cfg = tiny_config(config_name, "generator=random", f"ctx_manager.mode={mode}")
    rollout = _proxy(cfg, tiny_tokenizer, tiny_dir).rollout(val=False)
    batch = rollout.batch.batch
    B, T = batch["input_ids"].shape
    assert B == 8 and batch["responses"].shape == (B, T - 1)
    torch.testing.assert_close(batch["responses"], batch["input_ids"][:, 1:])
    attention = batch["attention_mask"]
    assert torch.all(attention[:, -1] == 1), "left padding: every row ends on a real token"
    torch.testing.assert_close(batch["position_ids"], (attention.cumsum(-1) - 1).clamp(min=0))
    assert torch.all(batch["loss_mask"] <= attention[:, 1:]), "no padding is ever trained"
    torch.testing.assert_close(batch["loss_mask"], batch["response_mask"])  # enable_response_mask=True
    nonzero = batch["rm_scores"] != 0
    assert nonzero.sum(-1).le(1).all() and torch.all(batch["loss_mask"][nonzero] == 1)
    tag = TAGS[config_name]
    assert {f"{tag}/success", f"{tag}/pass@2", f"{tag}/num_actions", "response_length"} <= set(rollout.metrics)


def test_sampled_positions_hold_exactly_the_generated_tokens(tiny_config, tiny_tokenizer, tiny_dir):
    cfg = tiny_config("_2_sokoban", "generator=random")
    rollout = _proxy(cfg, tiny_tokenizer, tiny_dir).rollout(val=False)
    batch = rollout.batch.batch
    for row, state in enumerate(rollout.states):
        sampled = [i for e in state.history if "response_ids" in e for i in e["response_ids"]]
        got = batch["responses"][row][batch["response_mask"][row].bool()].tolist()
        assert got == sampled


def test_score_is_the_return_plus_penalty_on_the_last_sampled_token(tiny_config, tiny_tokenizer, tiny_dir):
    cfg = tiny_config("_3_frozen_lake", "generator=random")
    rollout = _proxy(cfg, tiny_tokenizer, tiny_dir).rollout(val=False)
    batch = rollout.batch.batch
    for row, state in enumerate(rollout.states):
        expected = sum(e.get("reward", 0.0) for e in state.history) + state.penalty
        last = batch["response_mask"][row].nonzero().max().item()
        assert batch["rm_scores"][row, last].item() == pytest.approx(expected)


def test_released_loss_mask_covers_everything_after_the_system_turn(tiny_config, tiny_tokenizer, tiny_dir):
    cfg = tiny_config("_2_sokoban", "generator=random", "enable_response_mask=False")
    batch = _proxy(cfg, tiny_tokenizer, tiny_dir).rollout(val=False).batch.batch
    system = tiny_tokenizer("<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n",
                            add_special_tokens=False)["input_ids"]
    real = batch["attention_mask"].sum(-1)
    torch.testing.assert_close(batch["loss_mask"].sum(-1), (real - len(system)).float())
    assert torch.all(batch["loss_mask"] >= batch["response_mask"])


def test_train_seeds_advance_by_env_groups_and_val_seeds_are_fixed(tiny_config, tiny_tokenizer, tiny_dir):
    cfg = tiny_config("_2_sokoban", "generator=random")
    proxy = _proxy(cfg, tiny_tokenizer, tiny_dir)
    first = proxy.rollout(val=False).batch.non_tensor_batch["seeds"].tolist()
    second = proxy.rollout(val=False).batch.non_tensor_batch["seeds"].tolist()
    assert first == [10000, 10000, 10001, 10001, 10002, 10002, 10003, 10003]
    assert second == [s + 4 for s in first]
    assert proxy.rollout(val=True).batch.non_tensor_batch["seeds"].tolist()[:4] == [123, 123, 124, 124]
    assert proxy.rollout(val=True).batch.non_tensor_batch["seeds"].tolist()[:4] == [123, 123, 124, 124]
    assert proxy.state_dict()["train"] == {"seed_counter": 8}


@pytest.mark.slow
def test_tiny_model_rollout_reuses_sampled_ids(tiny_config, tiny_tokenizer, tiny_dir):
    cfg = tiny_config("_2_sokoban", "generator=hf", "agent_proxy.max_turn=2",
                      "actor_rollout_ref.rollout.response_length=16")
    rollout = _proxy(cfg, tiny_tokenizer, tiny_dir).rollout(val=False)
    batch = rollout.batch.batch
    for row, state in enumerate(rollout.states):
        sampled = [i for e in state.history if "response_ids" in e for i in e["response_ids"]]
        assert batch["responses"][row][batch["response_mask"][row].bool()].tolist() == sampled
        assert 1 <= len(state.history) - 1 <= 2


def test_unknown_env_tag_is_a_clear_error_before_any_env_is_built(tiny_config, tiny_tokenizer, tiny_dir):
    cfg = tiny_config("_2_sokoban", "generator=random", "es_manager.val.env_configs.tags=[Sokobann]")
    with pytest.raises(ValueError, match=r"es_manager.val.env_configs.tags: unknown env tag 'Sokobann' \(did you mean "
                                         r"HarderSokoban, SimpleSokoban, Sokoban2Boxes\?\); known tags"):
        _proxy(cfg, tiny_tokenizer, tiny_dir)


@pytest.mark.parametrize("override, message", [
    ("generator=vllm", "pip install 'spa-agent[gpu]'"),
    ("es_manager.train.env_configs.tags=[Foo]", "unknown env tag"),
])
def test_entry_points_report_user_errors_in_one_line(override, message, tmp_path, call_entry):
    """In this process (tests/datagen/test_generate_sft_data.py::test_cli_default_output_dir_and_usage_error and
    the run_spa.sh test start the entry point as a process)."""
    from SPA_agent import generate_sft_data

    code, err = call_entry(generate_sft_data, ["--config-name", "_2_sokoban", "model=tiny", override,
                                               f"data_gen.output_dir={tmp_path}"])
    assert code == 2 and message in err and err.startswith("error: ") and err.count("\n") == 1


def test_a_runs_seed_changes_its_sampled_rollouts_not_its_puzzles(tiny_config, tiny_tokenizer, tiny_dir):
    """Issue 43's seeds of a PPO run (docs/results/smollm2_table2/arms.txt): `trainer.seed=s generator.seed=s`.
    The rollouts sample from generator.seed's stream alone, so trainer.seed (torch's global seed: the critic's
    value head) without it would replay seed 0's first rollout; with it every seed samples its own, on the same
    puzzles."""
    def first_rollout(*seeds: str):
        cfg = tiny_config("_2_sokoban", "generator=hf", "agent_proxy.max_turn=1",
                          "actor_rollout_ref.rollout.response_length=16", *seeds)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.trainer.seed)  # the PPO entry point's seed_everything, for torch
            batch = _proxy(cfg, tiny_tokenizer, tiny_dir).rollout(val=False).batch
        return batch.batch["responses"].tolist(), batch.non_tensor_batch["seeds"].tolist()

    runs = {s: first_rollout(f"trainer.seed={s}", f"generator.seed={s}") for s in (0, 1, 2)}
    assert runs[0][1] == runs[1][1] == runs[2][1]  # the same puzzles
    assert runs[0][0] != runs[1][0] and runs[0][0] != runs[2][0] and runs[1][0] != runs[2][0]
    assert first_rollout("trainer.seed=1") == runs[0]

"""`trainer.max_wall_s` (stop with a checkpoint, exit 75, the same command continues) and
`trainer.save_merged_lora=False` (LoRA checkpoints of adapters and optimizer state only): together they let a run be
carried to another machine in pieces (docs/relay.md)."""

from __future__ import annotations

import shutil

import pytest
import torch
from peft.utils import load_peft_weights

from SPA_agent.runs import checkpoints, relay
from SPA_agent.runs.metrics_logger import read_metrics
from SPA_agent.trainer.config_checks import check_config
from SPA_agent.trainer.main_ppo import EXIT_TO_BE_CONTINUED, run
from SPA_agent.trainer.ppo_trainer import WallTimeReached

LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8", "critic.model.lora_rank=4",
        "actor_rollout_ref.actor.optim.lr=1e-2", "critic.optim.lr=1e-2", "trainer.test_freq=0")


@pytest.mark.slow
def test_a_slim_lora_run_stopped_by_the_clock_continues_elsewhere_as_if_never_stopped(ppo_config, tmp_path):
    """Three steps straight vs. max_wall_s=0 (it stops after step 1, with a checkpoint of adapters and optimizer
    state only), the run directory moved, then the same command without the limit: steps 2 and 3 give the same
    losses and the same adapters."""
    straight = run(ppo_config("_2_sokoban", *LORA, "trainer.total_training_steps=3", "trainer.save_freq=0",
                              f"trainer.default_local_dir={tmp_path / 'straight'}"))
    first = tmp_path / "first_machine"
    slim = (*LORA, "trainer.total_training_steps=3", "trainer.save_freq=0", "trainer.save_merged_lora=False")
    with pytest.raises(WallTimeReached) as stop:
        run(ppo_config("_2_sokoban", *slim, "trainer.max_wall_s=0", f"trainer.default_local_dir={first}"))
    assert (stop.value.step, stop.value.total) == (1, 3)
    assert checkpoints.saved_steps(first) == [1]
    for role in ("actor", "critic"):
        files = sorted(p.relative_to(first / "global_step_1" / role).as_posix()
                       for p in (first / "global_step_1" / role).rglob("*") if p.is_file())
        assert files == ["adapter/README.md", "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                         "optimizer.pt"], role
    relay.pack(tmp_path, ["first_machine"], tmp_path / "parts", part_mib=0.05)  # carried in parts
    shutil.rmtree(first)
    relay.unpack(tmp_path / "parts", tmp_path / "elsewhere")
    second = tmp_path / "elsewhere" / "first_machine"
    carried = run(ppo_config("_2_sokoban", *slim, f"trainer.default_local_dir={second}"))
    records = [read_metrics(d / "metrics.jsonl") for d in (straight, carried)]
    assert [r["step"] for r in records[1]] == [1, 2, 3]
    for step in (1, 2):  # steps 2 and 3
        for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "rollout/old_log_prob"):
            assert records[0][step][key] == pytest.approx(records[1][step][key], rel=1e-5, abs=1e-7), (step, key)
    for role in ("actor", "critic"):
        merged_run = straight / "global_step_3" / role / "adapter"
        slim_run = carried / "global_step_3" / role / "adapter"
        expected, got = load_peft_weights(str(merged_run)), load_peft_weights(str(slim_run))
        assert expected.keys() == got.keys() and expected
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_the_entry_point_exits_75_with_how_to_continue(tmp_path, call_entry):
    """(In this process; the PPO scripts run the same entry point as a process in tests/test_scripts*.)"""
    from SPA_agent.trainer import main_ppo

    code, err = call_entry(main_ppo, ["--config-name", "_2_sokoban", "model=tiny", "trainer.device=cpu",
                                      "trainer.total_training_steps=2", "trainer.max_wall_s=0", "trainer.test_freq=0",
                                      "es_manager.train.env_groups=2", "es_manager.train.env_configs.n_groups=[2]",
                                      "agent_proxy.max_turn=1", "actor_rollout_ref.rollout.response_length=8",
                                      "ppo_mini_batch_size=2", f"trainer.default_local_dir={tmp_path}"])
    assert code == EXIT_TO_BE_CONTINUED == 75
    assert "stopped after step 1 of 2" in err and "trainer.max_wall_s" in err and "resume_mode=auto" in err
    assert checkpoints.saved_steps(tmp_path) == [1]


@pytest.mark.parametrize(("overrides", "message"), [
    (("trainer.max_wall_s=-1",), r"trainer\.max_wall_s"),
    (("trainer.save_merged_lora=sometimes",), r"trainer\.save_merged_lora must be True or False"),
    (("trainer.save_merged_lora=False", "trainer.backend=verl", "trainer.n_gpus_per_node=1"),
     r"save_merged_lora=False is a setting of the local backend"),
])
def test_bad_values_are_one_line_errors(ppo_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        check_config(ppo_config("_2_sokoban", "trainer.total_training_steps=2", *overrides))

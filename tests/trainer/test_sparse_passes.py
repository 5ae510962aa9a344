"""Passes a run can make less often without changing what it learns: validation at chosen steps besides every
`trainer.test_freq`-th (`trainer.test_steps`), and the reference model's pass every `trainer.diagnostics.kl_freq`
steps when only the diagnostics' KL to the reference reads it."""

from __future__ import annotations

import pytest

from SPA_agent.runs.metrics_logger import read_metrics
from SPA_agent.trainer.config_checks import check_config
from SPA_agent.trainer.main_ppo import run

#: GRPO without a KL term: the reference pass feeds `diag/kl_ref/*` only
NO_KL = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=False",
         "algorithm.use_kl_in_reward=False", "trainer.total_training_steps=4", "trainer.save_freq=0",
         "trainer.diagnostics.mi_freq=0")
TRAINING = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout/old_log_prob", "critic/score/mean")


def test_a_sparse_reference_pass_measures_the_kl_at_its_steps_and_trains_the_same(ppo_config, tmp_path):
    """kl_freq=2 against every step: the same losses, gradients and samples at every step (nothing but the
    diagnostics reads the reference), the KL to the reference and the pass's timing at steps 2 and 4 only; and
    test_steps=[3] validates at step 3 besides test_freq's 2 and 4 (and step 0)."""
    runs = {}
    for kl_freq in (1, 2):
        out = tmp_path / f"kl_freq_{kl_freq}"
        run(ppo_config("_2_sokoban", *NO_KL, "trainer.test_steps=[3]", f"trainer.diagnostics.kl_freq={kl_freq}",
                       f"trainer.default_local_dir={out}"))
        runs[kl_freq] = {record["step"]: record for record in read_metrics(out / "metrics.jsonl")}
    every, sparse = runs[1], runs[2]
    for records in (every, sparse):
        assert [step for step, r in records.items() if "val-env/SimpleSokoban/success" in r] == [0, 2, 3, 4]
    assert [step for step in (1, 2, 3, 4) if "diag/kl_ref" in every[step]] == [1, 2, 3, 4]
    assert [step for step in (1, 2, 3, 4) if "diag/kl_ref" in sparse[step]] == [2, 4]
    assert [step for step in (1, 2, 3, 4) if "timing_s/ref" in sparse[step]] == [2, 4]
    for step in (1, 2, 3, 4):
        for key in TRAINING:
            assert sparse[step][key] == every[step][key], (step, key)
    for step in (2, 4):
        assert sparse[step]["diag/kl_ref"] == every[step]["diag/kl_ref"]


def test_a_kl_loss_reads_the_reference_every_step_whatever_kl_freq(ppo_config, tmp_path):
    run(ppo_config("_2_sokoban", *NO_KL[:1], "actor_rollout_ref.actor.use_kl_loss=True",
                   "trainer.total_training_steps=2", "trainer.save_freq=0", "trainer.test_freq=0",
                   "trainer.diagnostics.mi_freq=0", "trainer.diagnostics.kl_freq=0"))
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert [("actor/kl_loss" in r, "diag/kl_ref" in r) for r in records] == [(True, True), (True, True)]


@pytest.mark.parametrize("override, message", [
    ("trainer.diagnostics.kl_freq=-1", r"trainer\.diagnostics\.kl_freq"),
    ("trainer.diagnostics.kl_freq=abc", r"trainer\.diagnostics\.kl_freq"),
    ("trainer.test_steps=[0,275]", r"trainer\.test_steps lists training steps \(1 and up\)"),
    ("trainer.test_steps=225", r"trainer\.test_steps must be a list of integers such as trainer\.test_steps=\[225,275\]"),
])
def test_bad_schedules_are_one_line_errors_naming_the_key(ppo_config, override, message):
    with pytest.raises(ValueError, match=message):
        check_config(ppo_config("_2_sokoban", override))

"""Passes a run can make less often without changing what it learns: validation at chosen steps besides every
`trainer.test_freq`-th (`trainer.test_steps`), the reference model's pass every `trainer.diagnostics.kl_freq`
steps when only the diagnostics' KL to the reference reads it, and the old-log-prob pass not at all where the
update's own forward gives the same numbers (`actor.old_log_prob_from_update`)."""

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
#: four kept trajectories (two of four groups) in one mini-batch of four micro-batches
ONE_MINI_BATCH = ("es_manager.train.env_groups=4", "es_manager.train.env_configs.n_groups=[4]", "ppo_mini_batch_size=4")


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
    ("trainer.test_steps=225", r"trainer\.test_steps must be a list of integers such as "
                               r"trainer\.test_steps=\[225,275\]"),
])
def test_bad_schedules_are_one_line_errors_naming_the_key(ppo_config, override, message):
    with pytest.raises(ValueError, match=message):
        check_config(ppo_config("_2_sokoban", override))


def test_old_log_probs_from_the_update_forward_train_as_the_separate_pass_does(ppo_config, tmp_path):
    """One epoch, one mini-batch: the update's forward, before the step's only optimizer step, gives the old
    log-probs the separate pass gives, so the losses, gradients, samples and span diagnostics are those of a run
    with the pass (float rounding aside: the two passes batch the rows differently), the PPO ratio is exactly 1,
    and the step has no old_log_prob phase."""
    runs = {}
    for from_update in (False, True):
        out = tmp_path / f"from_update_{from_update}"
        run(ppo_config("_2_sokoban", *NO_KL[:-3], "trainer.total_training_steps=3", "trainer.save_freq=0",
                       "trainer.test_freq=0", "trainer.diagnostics.mi_freq=2", *ONE_MINI_BATCH,
                       f"actor_rollout_ref.actor.old_log_prob_from_update={from_update}",
                       f"trainer.default_local_dir={out}"))
        runs[from_update] = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    separate, from_update = runs[False], runs[True]
    for step in (1, 2, 3):
        assert "timing_s/old_log_prob" in separate[step] and "timing_s/old_log_prob" not in from_update[step]
        assert from_update[step]["actor/ppo_kl"] == 0.0 and from_update[step]["actor/pg_clipfrac"] == 0.0
        mi = [key for key in separate[step] if key.startswith("diag/mi/")]
        assert bool(mi) == (step == 2)  # mi_freq=2: the input dependence, measured before the update
        spans = [key for key in separate[step] if key.startswith(("diag/entropy/", "diag/kl_ref"))]
        assert "diag/entropy/all" in spans and "diag/kl_ref" in spans
        for key in [*TRAINING, *spans, "rollout/ref_log_prob", *mi]:
            assert from_update[step][key] == pytest.approx(separate[step][key], rel=1e-4, abs=1e-6), (step, key)


def test_a_critic_warm_up_step_makes_the_old_log_prob_pass_as_before(ppo_config, tmp_path):
    run(ppo_config("_2_sokoban", "algorithm.adv_estimator=gae", "trainer.critic_warmup=1",
                   "trainer.total_training_steps=2", "trainer.save_freq=0", "trainer.test_freq=0", *ONE_MINI_BATCH,
                   "actor_rollout_ref.actor.old_log_prob_from_update=True"))
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert [("timing_s/old_log_prob" in r, "actor/pg_loss" in r) for r in records] == [(True, False), (False, True)]
    assert all("diag/entropy/all" in r for r in records)


@pytest.mark.parametrize("override", ["actor_rollout_ref.actor.ppo_epochs=2", "algorithm.use_kl_in_reward=True",
                                      "trainer.backend=verl"])
def test_old_log_probs_from_the_update_need_one_epoch_the_local_backend_and_no_kl_in_reward(ppo_config, override):
    with pytest.raises(ValueError, match=r"old_log_prob_from_update=True takes the old log-probs from the update"):
        check_config(ppo_config("_2_sokoban", "actor_rollout_ref.actor.old_log_prob_from_update=True", override))

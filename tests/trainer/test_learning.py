"""The learning test: PPO must *learn*, not only run (config/_bandit.yaml, README "Learning test").

A two-armed bandit whose optimum is known (always pull Blue). Stage 1 plays it with the random generator, so
the self-play data names each arm about half the time; stage 2 (the real SFT trainer) teaches the tiny model
the answer format, which leaves it at chance (~0.6 success); stage 3 is the real PPO trainer (agent proxy,
context-manager masks, StarPO-S filter, verl's GAE or GRPO and losses, local backend) from that checkpoint.
Validation success (64 episodes sampled on the validation seeds by the trainer's own validation; every seed is
the same bandit) must go from chance before training to >= 0.9 at the end.

It fails when PPO's plumbing breaks: a flipped advantage sign, a loss mask shifted by one token or covering the
prompt, a misplaced score, old and new log-probs swapped (docs/ppo.md lists the hand-made mutations and what
each did to this test).

The multi-turn case plays the same bandit for three pulls, one per turn, and succeeds only when all three pull
the paying arm: the agent proxy's multi-turn context, the masks of every assistant turn and the returns across
turns (GAE with gamma = lambda = 1) must all work for PPO to get there. It starts from the one-turn case's SFT
checkpoint, whose answer format holds in every turn (each pull at chance, so about 0.15 success at step 0).

Four critic-free estimators (RLOO, REINFORCE++ and its baseline variant, Dr. GRPO) run only with
`pytest -m extended`: they take GRPO's path through the trainer (an outcome score, `algos.compute_advantages`,
the same actor loss), which the grpo case covers here, and their advantages, Dr. GRPO's preset and its loss
aggregation are pinned on hand-computed values by tests/trainer/test_outcome_estimators.py.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from sft import in_process as sft
from SPA_agent.config import compose
from SPA_agent.runs.metrics_logger import read_metrics
from SPA_agent.selfplay.generate import generate, prepare_data_gen_config
from SPA_agent.trainer.main_ppo import run

ROOT = Path(__file__).resolve().parents[2]

CONFIG = "_bandit"
SUCCESS = "val-env/Bandit/success"
CHANCE = (0.2, 0.8)  # step-0 validation success of the SFT checkpoint: about 0.6 (0.58 and 0.69 seen), below 0.9
TARGET = 0.9
#: the three-pull bandit of the multi-turn case: one pull per turn, success = all three pulls paid
MULTI_TURN = ["custom_envs.Bandit.env_config.num_pulls=3", "custom_envs.Bandit.max_actions_per_traj=3",
              "agent_proxy.max_turn=3"]
#: the three-turn test's SFT: the one-turn data and recipe at lr 3e-3, not the recipe's 1e-2. At 1e-2 the SFT is
#: chaotic: CPU kernels that round differently (AVX2 against AVX-512) give checkpoints that write different answers
#: in three-turn prompts, and from the AVX-512 ones (`<answer>Blue</>`) the test failed with every SFT seed tried
#: (1-4: 0.00 at step 16). At 3e-3 both kernel paths sample the same answers (docs/ppo.md "Multi-turn"). The one-turn
#: tests keep 1e-2.
MULTI_TURN_SFT = ["optim.lr=3e-3"]
#: from that checkpoint its step-0 success is 0.02-0.08 on seeds 0-4; GAE at the config's lr must reach this in
#: 16 steps (0.83 to 0.95 on seeds 0-4 with either kernel path), validated before training and at the last step only
MULTI_TURN_STEPS, MULTI_TURN_TARGET = 16, 0.8
MULTI_TURN_PPO = [f"trainer.total_training_steps={MULTI_TURN_STEPS}", f"trainer.test_freq={MULTI_TURN_STEPS}"]
#: the same with a <think> block before each answer, the format of the SPA tasks (64 new tokens hold it)
THINKING = [*MULTI_TURN, "agent_proxy.enable_think=True", "actor_rollout_ref.rollout.response_length=64"]
#: three-turn rows (prompts up to ~520 tokens) need longer SFT sequences than the one-turn test (the thinking test's
#: own SFT checkpoint)
LONG_ROWS = ["data.max_length=1024", "data.max_tokens_per_micro_batch=4096"]
#: GAE's critic trains alone for its first 2 steps (issue 25): a fresh critic's values are noise, so with
#: gamma = lambda = 1 every token after the arm, `</answer><|im_end|>` included, carries the whole outcome advantage;
#: once most answers pay, whitening makes a lone malformed answer a -4 sigma outlier, and at this lr one update
#: pushed the format tokens every answer shares down until no answer parsed (seed 2 on one machine, seed 0 on
#: another). With the warm-up every seed of docs/ppo.md's table reaches the target.
GAE = ["algorithm.adv_estimator=gae", "trainer.critic_warmup=2"]
#: the estimators and algorithm presets (docs/ppo.md "Advantage estimators"): their overrides of the config
VARIANTS = {
    "gae": GAE,
    "grpo": ["algorithm.adv_estimator=grpo"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "dr_grpo": ["+algo=dr_grpo"],
    "dapo": ["+algo=dapo"],
    "gigpo": ["algorithm.adv_estimator=gigpo"],
}
#: the estimators whose learning run is left to `pytest -m extended` (the module docstring says what covers them)
EXTENDED_VARIANTS = ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "dr_grpo")
#: where the child process writes the traceback of a run that raised (its test fails with it)
ERROR_FILE = "error.txt"


def bandit_sft_checkpoint(root: Path, env_overrides: Sequence[str], sft_overrides: Sequence[str] = ()) -> Path:
    """Stages 1 and 2: random-policy bandit data, then SFT of the tiny model on it (one torch thread, as the
    trainer tests: the module-scoped fixtures below run before their function-scoped thread fixture)."""
    base = compose(CONFIG, env_overrides)
    data_cfg = compose(CONFIG, [*env_overrides, *base.learning_test.data_gen_overrides,
                                f"data_gen.output_dir={root / 'data'}"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        card = generate(prepare_data_gen_config(data_cfg, CONFIG))
        assert card["num_train"] > 50
        data = root / "data"
        return sft.train([f"data.train_files={data / 'wm_train.parquet'}", f"data.val_files={data / 'wm_val.parquet'}",
                          "model.partial_pretrain=tiny", f"trainer.default_local_dir={root / 'sft'}",
                          *base.learning_test.sft_overrides, *sft_overrides])
    finally:
        torch.set_num_threads(threads)


#: the SFT checkpoints of the learning runs, by name: their overrides of the SFT on the one-turn data
SFT_CHECKPOINTS = {"one_turn": [], "three_turn": MULTI_TURN_SFT}


def shared_sft_checkpoint(root: Path, name: str = "one_turn") -> Path:
    """SFT checkpoint `name` (SFT_CHECKPOINTS) under root/name: made by the first learning run of the session that
    starts from it, read by the others."""
    made = root / name / "sft_checkpoint.txt"
    if not made.exists():
        made.parent.mkdir(parents=True, exist_ok=True)
        made.write_text(str(bandit_sft_checkpoint(made.parent / f"build-{os.getpid()}", [], SFT_CHECKPOINTS[name])))
    return Path(made.read_text())


def run_name(test: str, parameters: dict) -> str:
    """The directory of a learning test's PPO run: its estimator, or three_turn."""
    return parameters.get("estimator", "three_turn")


def run_overrides(name: str) -> list[str]:
    return [*MULTI_TURN, *MULTI_TURN_PPO] if name == "three_turn" else VARIANTS[name]


def run_checkpoint(name: str) -> str:
    """The SFT checkpoint (SFT_CHECKPOINTS) a learning test's run starts from: its own, else the one-turn one."""
    return name if name in SFT_CHECKPOINTS else "one_turn"


def learning_runs(directory: Path, tests: list[tuple[str, dict]]) -> dict:
    """The PPO runs of the selected learning tests, one after another in one child process (this file as a script,
    below) that runs beside the other tests (tests/conftest.py, `background`): one interpreter start and one import of
    the trainer for all of them, about 10 s of CPU each on a 2-core machine. Each run starts from an SFT checkpoint
    of the one-turn data (the three-turn run's at MULTI_TURN_SFT's lr), which the process makes when a run first
    needs it, and writes <directory>/<run_name>; each run seeds every RNG it uses (main_ppo.build_trainer), so its
    curve is the one it has in a process of its own."""
    runs = [[str(directory / name), run_checkpoint(name), run_overrides(name)]
            for name in dict.fromkeys(run_name(*test) for test in tests)]
    return {"args": [sys.executable, __file__, str(directory / "bandit_sft"), json.dumps(runs)],
            "cwd": ROOT, "env": {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
            "timeout": 900 * len(runs)}


def finished_run(background_run, name: str):
    """(metric records, validation success by step, config) of a learning test's run in the child process."""
    (result,), directory = background_run
    run_dir = directory / name
    error = run_dir / ERROR_FILE
    assert not error.exists(), error.read_text()[-6000:]
    assert (run_dir / "metrics.jsonl").exists(), result.stdout[-2000:] + result.stderr[-6000:]
    records = read_metrics(run_dir / "metrics.jsonl")
    return records, {r["step"]: r[SUCCESS] for r in records if SUCCESS in r}, OmegaConf.load(run_dir / "config.yaml")


@pytest.fixture(scope="module")
def thinking_sft_checkpoint(tmp_path_factory) -> Path:
    return bandit_sft_checkpoint(tmp_path_factory.mktemp("bandit3think"), THINKING, LONG_ROWS)


@pytest.mark.slow
@pytest.mark.background(command=learning_runs)
@pytest.mark.parametrize("estimator", [pytest.param(e, marks=pytest.mark.extended) if e in EXTENDED_VARIANTS else e
                                       for e in VARIANTS])
def test_ppo_learns_the_bandit_from_chance(background_run, estimator):
    records, curve, cfg = finished_run(background_run, estimator)
    print(f"{estimator}: validation success by step {curve}")
    assert CHANCE[0] <= curve[0] <= CHANCE[1], f"the SFT checkpoint is not at chance: {curve}"
    final = curve[cfg.trainer.total_training_steps]
    assert final >= TARGET, f"{estimator}: validation success {final:.2f} < {TARGET} after PPO; curve {curve}"
    trained_critic = any("critic/vf_loss" in r for r in records)
    assert trained_critic == (estimator == "gae"), "critic-free estimators must not build or train a critic; GAE must"


def check_three_turn_learning(records: list[dict], cfg) -> None:
    """The three-turn bandit's validation success: from at most 0.3 to MULTI_TURN_TARGET at the last step."""
    curve = {r["step"]: r[SUCCESS] for r in records if SUCCESS in r}
    print(f"three-turn bandit, {cfg.algorithm.adv_estimator}: validation success by step {curve}")
    assert curve[0] <= 0.3, f"the SFT checkpoint already solves the three-turn bandit: {curve}"
    final = curve[cfg.trainer.total_training_steps]
    assert final >= MULTI_TURN_TARGET, f"validation success {final:.2f} < {MULTI_TURN_TARGET} after PPO; curve {curve}"


@pytest.mark.slow
@pytest.mark.background(command=learning_runs)
def test_ppo_learns_a_three_turn_bandit(background_run):
    records, _, cfg = finished_run(background_run, "three_turn")
    check_three_turn_learning(records, cfg)


@pytest.mark.extended  # about 2 minutes: not in the default run (CI); `python -m pytest -m extended`
def test_grpo_learns_a_three_turn_bandit_with_thinking(thinking_sft_checkpoint, tmp_path):
    """GRPO (GAE from a fresh critic breaks the <think> format of this tiny model at its lr, docs/ppo.md), which
    reaches the target in 12 steps here at lr 1e-3 (measured before the config's lr became 5e-4)."""
    cfg = compose(CONFIG, [*THINKING, "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr=1e-3",
                           "trainer.total_training_steps=12", f"model_path={thinking_sft_checkpoint}",
                           f"trainer.default_local_dir={tmp_path / 'run'}"])
    check_three_turn_learning(read_metrics(run(cfg) / "metrics.jsonl"), cfg)


if __name__ == "__main__":  # the learning tests' child process: <SFT root> <JSON [[run dir, SFT checkpoint name,
    # overrides], ...]>, one torch thread
    torch.set_num_threads(1)
    sft_root, runs = sys.argv[1], json.loads(sys.argv[2])
    failed = []
    for run_dir, sft_name, overrides in runs:
        try:
            checkpoint = shared_sft_checkpoint(Path(sft_root), sft_name)
            run(compose(CONFIG, [f"model_path={checkpoint}", *overrides, f"trainer.default_local_dir={run_dir}"]))
        except Exception:  # the run's test fails with it (finished_run); the other runs go on
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / ERROR_FILE).write_text(traceback.format_exc())
            failed.append(run_dir)
    sys.exit(f"failed: {', '.join(failed)}" if failed else 0)

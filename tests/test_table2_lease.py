"""Issue 43's Table 2 lease (docs/results/smollm2_table2): its arms are the rows' recipe, three seeds each, in the
priority order the lease runs them, and every arm's PPO config composes for SmolLM2 and passes the PPO checks. Its
speed gate: a sweep with WAIT_FOR adds the gate file's overrides to every arm, and job.sh writes the gate from
the step benchmarks of its variants (stubbed here: no model runs), or an empty one when it cannot time the baseline."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from SPA_agent.config import compose
from SPA_agent.evaluation.evaluate import prepare_eval_config
from SPA_agent.trainer.config_checks import check_config

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "docs" / "results" / "smollm2_table2"
#: the repository's python first, as the lease's PATH has it
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
#: what each start of benchmarks/smollm2_sweep.sh makes a row: (prompt mode, render mode, experiment override)
ROWS = {"wm": ("spa", "add_worldmodel", "text_with_coordinates"), "nowm": ("format", "base", "text_with_coordinates"),
        "base": ("vanilla", "base", "text")}
#: the settings job.sh gives every sweep (benchmarks/smollm2_sweep.sh's PPO array)
SWEEP = ["ctx_manager.mode=base", "trainer.total_training_steps=300", "trainer.test_freq=25", "trainer.save_freq=0",
         "es_manager.val.group_size=4"]
#: overrides that may differ between arms: the prompts, the Vanilla RL render and the seed
PER_ARM = ("ctx_manager.mode", "experiment", "trainer.seed", "generator.seed")


def all_arms() -> list[tuple[str, str, list[str]]]:
    lines = [line.split() for line in (HERE / "arms.txt").read_text().splitlines() if line and line[0] != "#"]
    return [(name, start, overrides) for name, start, *overrides in lines]


def arms() -> list[tuple[str, str, list[str]]]:
    """The arms of the paper's rows (spa, format, vanilla), not those of settings beyond the paper (spa_ptx, ...)."""
    return [arm for arm in all_arms() if re.fullmatch(r"(spa|format|vanilla)_s\d", arm[0])]


def test_arms_are_three_seeds_of_each_row_in_the_lease_priority_order():
    names = [name for name, _, _ in arms()]
    assert names == ["spa_s0", "format_s0", "vanilla_s0", "spa_s1", "spa_s2", "format_s1", "format_s2",
                     "vanilla_s1", "vanilla_s2"]
    for name, start, overrides in arms():
        row, seed = re.fullmatch(r"(\w+)_s(\d)", name).groups()
        assert ROWS[start][0] == row
        settings = dict(o.split("=", 1) for o in overrides)
        assert settings["trainer.seed"] == settings["generator.seed"] == seed  # the run's seed: init and sampling
        assert settings["ctx_manager.mode"] == ROWS[start][1]
        assert settings.get("experiment") == ("vanilla_rl" if start == "base" else None)


def test_arms_share_one_ppo_recipe():
    recipes = {tuple(sorted(o for o in overrides if o.split("=")[0] not in PER_ARM)) for _, _, overrides in arms()}
    assert recipes == {("actor_rollout_ref.actor.optim.lr=1e-5", "critic.optim.lr=1e-4")}


def test_the_ppo_ptx_arm_is_spa_seed_0_with_the_sft_loss_on_its_sweeps_sft_data():
    """Beyond the paper: SPA's seed-0 arm keeping the world-model SFT's loss during PPO (docs/ppo.md)."""
    extra = {"spa_ptx_s0": ["actor_rollout_ref.actor.sft_aux_coef=0.1",
                            "actor_rollout_ref.actor.sft_aux_files={data}/wm_train.parquet"]}
    beyond = {name: (start, overrides) for name, start, overrides in all_arms() if (name, start, overrides) not in arms()}
    spa = next(overrides for name, _, overrides in arms() if name == "spa_s0")
    assert beyond == {name: ("wm", spa + overrides) for name, overrides in extra.items()}


@pytest.mark.parametrize("name, start, overrides", all_arms(), ids=[a[0] for a in all_arms()])
def test_each_arm_composes_for_smollm2_and_passes_the_ppo_checks(name, start, overrides):
    overrides = [o.replace("{data}", "/sweep/data") for o in overrides]  # as smollm2_sweep.sh substitutes it
    cfg = compose("_2_sokoban", ["model=smollm2-135m", *SWEEP, *overrides])
    check_config(cfg)
    assert (cfg.ctx_manager.mode, cfg.render_mode) == ROWS[start][1:]
    assert cfg.trainer.val_before_train is True  # step 0 validates the starting model: the Base and SFT-only rows
    assert cfg.es_manager.val.env_groups * cfg.es_manager.val.group_size == 512  # 128 puzzles x 4
    assert cfg.generator.seed == cfg.trainer.seed == int(name[-1])


def study300_arms() -> list[tuple[str, str, list[str]]]:
    path = HERE.parent / "smollm2_study300" / "arms.txt"
    lines = [line.split() for line in path.read_text().splitlines() if line and line[0] != "#"]
    return [(name, start, overrides) for name, start, *overrides in lines]


def test_the_300_step_study_runs_the_first_studys_four_settings_from_the_world_model_sft_in_base_prompts():
    first = [line.split() for line in (HERE.parent / "smollm2_study_h200x4" / "arms.txt").read_text().splitlines()]
    assert [(name, start, overrides) for name, start, *overrides in [[line[0], "wm", "ctx_manager.mode=base",
                                                                     *line[1:]] for line in first]] == study300_arms()[:4]


def test_the_studys_second_lease_runs_the_two_learning_settings_from_the_format_only_sft_and_with_seed_1():
    lease1 = {name: overrides for name, _, overrides in study300_arms()[:4]}
    lease2 = {name: (start, overrides) for name, start, overrides in study300_arms()[4:10]}
    for setting, control in [("gae_kl_3e-5", "format_kl_3e-5"), ("grpo_guard", "format_grpo_guard")]:
        assert lease2[control] == ("nowm", [*lease1[setting], "trainer.seed=0", "generator.seed=0"])
        assert lease2[f"{control}_s1"] == ("nowm", [*lease1[setting], "trainer.seed=1", "generator.seed=1"])
        assert lease2[f"{setting}_s1"] == ("wm", [*lease1[setting], "trainer.seed=1", "generator.seed=1"])
    assert len(lease2) == 6


def test_the_studys_third_lease_adds_seed_2_of_both_settings_from_both_sfts():
    lease1 = {name: overrides for name, _, overrides in study300_arms()[:4]}
    lease3 = {name: (start, overrides) for name, start, overrides in study300_arms()[10:14]}
    seed2 = ["trainer.seed=2", "generator.seed=2"]
    assert lease3 == {"grpo_guard_s2": ("wm", [*lease1["grpo_guard"], *seed2]),
                      "format_grpo_guard_s2": ("nowm", [*lease1["grpo_guard"], *seed2]),
                      "gae_kl_3e-5_s2": ("wm", [*lease1["gae_kl_3e-5"], *seed2]),
                      "format_kl_3e-5_s2": ("nowm", [*lease1["gae_kl_3e-5"], *seed2])}


def test_the_studys_fourth_lease_runs_vanilla_rl_and_spa_in_its_own_prompts_under_the_grpo_guard():
    """Table 2's Vanilla RL and SPA rows under the PPO of the grpo_guard rows (three seeds of each SFT), and seed 3
    of both grpo_guard rows."""
    guard = {name: overrides for name, _, overrides in study300_arms()[:4]}["grpo_guard"]
    lease4 = {name: (start, overrides) for name, start, overrides in study300_arms()[14:20]}
    assert guard[0] == "ctx_manager.mode=base"
    seed3 = ["trainer.seed=3", "generator.seed=3"]
    assert lease4 == {
        "grpo_guard_s3": ("wm", [*guard, *seed3]), "format_grpo_guard_s3": ("nowm", [*guard, *seed3]),
        **{f"vanilla_grpo_guard{suffix}": ("base", ["experiment=vanilla_rl", *guard, f"trainer.seed={seed}",
                                                      f"generator.seed={seed}"])
           for seed, suffix in enumerate(["", "_s1", "_s2"])},
        "spa_grpo_guard": ("wm", ["ctx_manager.mode=add_worldmodel", *guard[1:],
                                  "actor_rollout_ref.rollout.compact_decode_rows=16", "trainer.seed=0",
                                  "generator.seed=0"])}


def test_the_studys_fifth_lease_adds_seeds_4_to_6_of_both_grpo_guard_rows():
    guard = {name: overrides for name, _, overrides in study300_arms()[:4]}["grpo_guard"]
    lease5 = {name: (start, overrides) for name, start, overrides in study300_arms()[20:26]}
    assert lease5 == {f"{prefix}grpo_guard_s{seed}": (start, [*guard, f"trainer.seed={seed}", f"generator.seed={seed}"])
                      for seed in (4, 5, 6) for prefix, start in [("", "wm"), ("format_", "nowm")]}


def test_the_studys_seventh_lease_adds_seeds_7_to_9_of_both_grpo_guard_rows():
    """New seed numbers for new SFT checkpoints: a seed run again from another checkpoint is another observation."""
    guard = {name: overrides for name, _, overrides in study300_arms()[:4]}["grpo_guard"]
    lease7 = {name: (start, overrides) for name, start, overrides in study300_arms()[26:32]}
    assert lease7 == {f"{prefix}grpo_guard_s{seed}": (start, [*guard, f"trainer.seed={seed}", f"generator.seed={seed}"])
                      for seed in (7, 8, 9) for prefix, start in [("", "wm"), ("format_", "nowm")]}


def test_the_studys_eighth_lease_adds_world_model_seeds_10_to_12_and_vanilla_rl_seeds_3_to_5():
    """Vanilla RL: lease 4's arms' recipe (the untouched model on the plain grid, grpo_guard) with new seeds."""
    guard = {name: overrides for name, _, overrides in study300_arms()[:4]}["grpo_guard"]
    _, vanilla = {name: (start, overrides) for name, start, overrides in study300_arms()}["vanilla_grpo_guard"]
    vanilla = vanilla[:-2]  # without its seed's two overrides
    lease8 = {name: (start, overrides) for name, start, overrides in study300_arms()[32:38]}

    def seeded(overrides: list[str], seed: int) -> list[str]:
        return [*overrides, f"trainer.seed={seed}", f"generator.seed={seed}"]

    assert lease8 == {**{f"grpo_guard_s{seed}": ("wm", seeded(guard, seed)) for seed in (10, 11, 12)},
                      **{f"vanilla_grpo_guard_s{seed}": ("base", seeded(vanilla, seed)) for seed in (3, 4, 5)}}


def test_the_studys_leases_9_and_12_to_17_run_spa_under_grpo_guard_in_its_own_prompts():
    """Lease 4's spa_grpo_guard with other seeds: 1 and 2 in lease 9, 3 in lease 12, 4 in lease 15, 5 in lease 16
    (one H200 each), 6 and 7 in lease 17 with three passes made less often or not at all; beside seed 3, the
    same PPO (seed 1's) from the SFT without the prediction's loss (start nopred), whose seeds 2 and 3 are leases 13
    and 14's, each beside a seed of the same PPO from the SFT without either state's loss (start nostate)."""
    _, own_prompts = {name: (start, overrides) for name, start, overrides in study300_arms()}["spa_grpo_guard"]

    def seeded(seed: int) -> list[str]:
        return [*own_prompts[:-2], f"trainer.seed={seed}", f"generator.seed={seed}"]

    lease9 = {name: (start, overrides) for name, start, overrides in study300_arms()[38:40]}
    assert lease9 == {f"spa_grpo_guard_s{seed}": ("wm", seeded(seed)) for seed in (1, 2)}
    lease12 = {name: (start, overrides) for name, start, overrides in study300_arms()[42:44]}
    assert lease12 == {"spa_grpo_guard_s3": ("wm", seeded(3)), "nopred_grpo_guard_s1": ("nopred", seeded(1))}
    leases13_14 = [(name, start, overrides) for name, start, overrides in study300_arms()[44:48]]
    assert leases13_14 == [("nopred_grpo_guard_s2", "nopred", seeded(2)),
                           ("nostate_grpo_guard_s1", "nostate", seeded(1)),
                           ("nopred_grpo_guard_s3", "nopred", seeded(3)),
                           ("nostate_grpo_guard_s2", "nostate", seeded(2))]
    leases15_17 = {name: (start, overrides) for name, start, overrides in study300_arms()[48:]}
    sparse = ["trainer.validation_steps=1", "trainer.diagnostics.kl_freq=25",  # lease 17's: step 275 in time
              "actor_rollout_ref.actor.old_log_prob_from_update=True"]
    assert leases15_17 == {**{f"spa_grpo_guard_s{seed}": ("wm", seeded(seed)) for seed in (4, 5)},
                           **{f"spa_grpo_guard_s{seed}": ("wm", [*seeded(seed), *sparse]) for seed in (6, 7)}}


def test_the_studys_tenth_lease_runs_spa_in_its_own_prompts_under_the_ppo_of_the_format_only_rows_best():
    """Lease 10: gae_kl_3e-5's overrides (with which format_kl_3e-5 reached 0.551 and 0.603) in the world-model SFT's
    own prompts, spa_grpo_guard's decode compaction, seeds 1 and 2."""
    arms = {name: (start, overrides) for name, start, overrides in study300_arms()}
    _, kl = arms["gae_kl_3e-5"]
    _, own_prompts = arms["spa_grpo_guard"]
    compaction = [o for o in own_prompts if o.startswith("actor_rollout_ref.rollout.compact_decode_rows=")]
    lease10 = {name: (start, overrides) for name, start, overrides in study300_arms()[40:42]}
    assert lease10 == {f"spa_kl_3e-5_s{seed}": ("wm", ["ctx_manager.mode=add_worldmodel", *kl[1:], *compaction,
                                                       f"trainer.seed={seed}", f"generator.seed={seed}"])
                       for seed in (1, 2)}
    assert kl[0] == "ctx_manager.mode=base" and arms["format_kl_3e-5"][1][1:-2] == kl[1:]


@pytest.mark.parametrize("name, start, overrides", study300_arms(), ids=[a[0] for a in study300_arms()])
def test_each_300_step_study_arm_composes_for_smollm2_and_passes_the_ppo_checks(name, start, overrides):
    cfg = compose("_2_sokoban", ["model=smollm2-135m", *SWEEP, *overrides])
    check_config(cfg)
    prompts = {"base": ("base", "text"), "wm": ("add_worldmodel" if name.startswith("spa_") else "base",
                                                 "text_with_coordinates"), "nowm": ("base", "text_with_coordinates"),
               "nopred": ("add_worldmodel", "text_with_coordinates"),
               "nostate": ("add_worldmodel", "text_with_coordinates")}
    assert (cfg.ctx_manager.mode, cfg.render_mode) == prompts[start]
    assert cfg.trainer.total_training_steps == 300 and cfg.trainer.test_freq == 25
    assert cfg.es_manager.val.env_groups * cfg.es_manager.val.group_size == 512  # 128 puzzles x 4



def test_the_300_step_studys_command_puts_two_arms_a_gpu_after_one_sft(tmp_path):
    """Its README's command: every arm in the wm sweep, placed as named (the SFT on GPU 0)."""
    work, _ = run_job(tmp_path, GATE="off", ARMS_FILE=str(HERE.parent / "smollm2_study300" / "arms.txt"),
                      ARMS="gae_warmup@0 gae_kl_3e-5@0 grpo_guard@1 lora_r32@1", PATH=with_gpus(tmp_path, 2))
    assert (work / "table2_wm" / "logs" / "gpu_ids").read_text().strip() == "0 0 1 1"
    assert not (work / "table2_nowm").exists() and not (work / "table2_base").exists()


@pytest.mark.parametrize("lease, wm_gpus, nowm_gpus, base_gpus",
                         [("## Lease 2", "0 0", "1 1 0 1", None), ("## Lease 3", "0 1 0", "1 0 1", None),
                          ("## Lease 4", "0 1", "1", "0 0 1"), ("## Lease 5", "0 0 1", "1 1 0", None)])
def test_the_300_step_studys_later_leases_put_three_arms_a_gpu_each_with_its_share(tmp_path, lease, wm_gpus,
                                                                                    nowm_gpus, base_gpus):
    """Their README's commands: the world-model SFT on GPU 0, the format-only SFT on GPU 1, three arms on each GPU,
    every arm with the sharing overrides (which compose and pass the PPO checks); Vanilla RL's arms without an SFT."""
    command = study_readme_from(lease)
    overrides = re.search(r'OVERRIDES="([^"]+)"', command).group(1)
    arms = re.search(r'ARMS="([^"]+)"', command).group(1)
    wm_eval = re.search(r"WM_EVAL=(\d)", command[:command.index("job.sh")])
    work, _ = run_job(tmp_path, GATE="off", ARMS_FILE=str(HERE.parent / "smollm2_study300" / "arms.txt"),
                      ARMS=arms, OVERRIDES=overrides, PATH=with_gpus(tmp_path, 2),
                      **({"WM_EVAL": wm_eval[1]} if wm_eval else {}))
    assert (work / "table2_wm" / "logs" / "wm_eval").read_text().strip() == (wm_eval[1] if wm_eval else "0")
    assert (work / "table2_nowm" / "logs" / "wm_eval").read_text().strip() == "0"  # no world model taught there
    assert (work / "table2_wm" / "logs" / "gpu_ids").read_text().strip() == wm_gpus
    assert (work / "table2_nowm" / "logs" / "gpu_ids").read_text().strip() == nowm_gpus
    base = work / "table2_base" / "logs" / "gpu_ids"
    assert (base.read_text().strip() if base_gpus else base.exists()) == (base_gpus or False)
    assert [a.split("@")[1] for a in arms.split()].count("0") == 3 and len(arms.split()) == 6
    settings = (work / "table2_nowm" / "logs" / "settings").read_text()
    assert all(line.endswith(overrides) for line in settings.splitlines() if line)
    cfg = compose("_2_sokoban", ["model=smollm2-135m", *SWEEP, *study300_arms()[4][2], *overrides.split()])
    check_config(cfg)
    assert cfg.trainer.cuda_memory_fraction * 3 < 1 and cfg.generator.batch_size == 256  # validation: 2 x 256 rows
    assert cfg.generator.max_batch_tokens is None

#: issue 42's benchmarks as lease.sh runs them, stubbed: each records its GPU (and the SFT its limit and overrides)
BENCH_STUBS = {
    "smollm2_step.sh": 'mkdir -p "$1"; echo "$CUDA_VISIBLE_DEVICES $SFT_TIMEOUT $SFT_ONLY $SFT_OVERRIDES" > "$1/env"\n'
                       'printf "sft\\t55.0\\t0\\n" > "$1/times.tsv"\n',
    "ppo_step.py": "import json, os, sys\nout = os.environ['WORK'] + '/out/'\n"
                   "open(out + 'ppo_env', 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])\n"
                   "open(out + 'ppo_args', 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                   "if os.environ.get('PPO_STEP_FAILS') and '--override' in sys.argv:\n    sys.exit(1)\n"
                   "print('{\"seconds\": 19.5}')\n",
}


def run_lease_script(tmp_path: Path, **env: str) -> tuple[Path, Path]:
    """lease.sh in a copy of the tree with the sweep and the benchmarks stubbed, on a host of two GPUs; (work dir,
    the study's folder)."""
    study = REPO / "docs" / "results" / "smollm2_study300"
    repo, work = stub_tree(tmp_path), tmp_path / "work"
    (repo / "docs" / "results" / "smollm2_study300").mkdir()
    for name in ("lease.sh", "arms.txt"):
        shutil.copy(study / name, repo / "docs" / "results" / "smollm2_study300" / name)
    shutil.copytree(REPO / "config", repo / "config")  # job.sh refuses a CONFIG without config/<CONFIG>.yaml
    for name, text in BENCH_STUBS.items():
        (repo / "benchmarks" / name).write_text(text)
    env = {**ENV, "MODEL": "tiny", "WORK": str(work), "PATH": with_gpus(tmp_path, 2), **env}
    lease = subprocess.run(["bash", "docs/results/smollm2_study300/lease.sh"], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=60)
    assert lease.returncode == 0, lease.stderr
    return work, study


def study_readme_from(heading: str) -> str:
    """The 300-step study's README from `heading` (a lease's section, e.g. "## Lease 9") to its end: the first
    ARMS=, SHARE=, ... after it are that lease's command's."""
    readme = (REPO / "docs" / "results" / "smollm2_study300" / "README.md").read_text()
    return readme[readme.index(heading):]


def lease_overrides(study: Path, share: str, sharing: bool = True) -> str:
    """The OVERRIDES lease.sh gives job.sh (not SFT_OVERRIDES), with SHARE=`share`, and with its sharing overrides
    unless SHARING=0 (`sharing` False)."""
    script = (study / "lease.sh").read_text()
    overrides = re.search(r'(?<![_A-Z])OVERRIDES="([^"]+)"', script).group(1)
    sharing_overrides = re.search(r'SHARING_OVERRIDES="([^"]+)"', script).group(1)
    overrides = overrides.replace("${SHARE:-0.3}", share)
    return overrides.replace("${SHARING_OVERRIDES:+ $SHARING_OVERRIDES}", f" {sharing_overrides}" if sharing else "")


def test_the_300_step_studys_lease_script_runs_its_readmes_eighth_lease(tmp_path):
    """lease.sh with the README's lease 8 command (as it ran): one world-model SFT (on GPU 0), the arms placed as
    named (three a GPU: the Vanilla RL arms need no SFT), every arm with lease.sh's sharing overrides and its stop
    rule, STEPS through to the sweeps, and the world model evaluated after PPO."""
    command = study_readme_from("## Lease 8")
    arms, steps = re.search(r'ARMS="([^"]+)"', command).group(1), re.search(r"STEPS=(\d+)", command).group(1)
    assert re.search(r"BENCH=(\d)", command).group(1) == "0"
    work, study = run_lease_script(tmp_path, BENCH="0", ARMS=arms, STEPS=steps)
    overrides = lease_overrides(study, share="0.3")
    assert not (work / "out" / "b42").exists()
    assert not (work / "table2_nowm").exists()
    placed = {"wm": (["0", "0", "1"], [f"grpo_guard_s{seed}" for seed in (10, 11, 12)]),
              "base": (["0", "1", "1"], [f"vanilla_grpo_guard_s{seed}" for seed in (3, 4, 5)])}
    for start, (gpus, names) in placed.items():
        log = work / f"table2_{start}" / "logs"
        assert (log / "gpu_ids").read_text().split() == gpus
        assert (log / "steps").read_text().strip() == steps == "275"
        assert (log / "wm_eval").read_text().strip() == ("1" if start == "wm" else "0")
        settings = [line for line in (log / "settings").read_text().splitlines() if line]
        assert [line.split()[0] for line in settings] == names
        assert all(line.endswith(overrides) for line in settings)
    assert "trainer.stop_after_uniform_scores=20" in overrides
    assert "config=_2_sokoban gpus=2" in (work / "out" / "progress.txt").read_text()
    vanilla = {name: overrides for name, _, overrides in study300_arms()}["vanilla_grpo_guard_s5"]
    cfg = compose("_2_sokoban", ["model=smollm2-135m", *SWEEP, *vanilla, *overrides.split()])
    check_config(cfg)
    assert cfg.trainer.log_val_generations == 8 and cfg.trainer.cuda_memory_fraction * 3 < 1


@pytest.mark.parametrize("lease, names, estimator, kl_loss", [
    ("## Lease 9", ["spa_grpo_guard_s1", "spa_grpo_guard_s2"], "grpo", False),
    ("## Lease 10", ["spa_kl_3e-5_s1", "spa_kl_3e-5_s2"], "gae", True),
    ("## Lease 15", ["spa_grpo_guard_s4"], "grpo", False),
    ("## Lease 16", ["spa_grpo_guard_s5"], "grpo", False),
    ("## Lease 17", ["spa_grpo_guard_s6", "spa_grpo_guard_s7"], "grpo", False)],
    ids=["ninth", "tenth", "fifteenth", "sixteenth", "seventeenth"])
def test_the_lease_script_runs_its_readmes_own_prompt_leases_one_arm_a_gpu_with_the_larger_share(
        tmp_path, lease, names, estimator, kl_loss):
    """Leases 9, 15, 16 (as they ran; 15 and 16 on one GPU), 10 and 17: SPA in its own prompts, one arm alone on each
    GPU after the world-model SFT, each arm's memory share SHARE; lease.sh's OVERRIDES with it compose and pass the PPO
    checks, under grpo_guard (leases 9, 15, 16, 17) and under gae_kl_3e-5 (lease 10: a critic and the reference
    model's KL loss beside the actor). Leases 15 to 17's SHARING=0 leaves out the sharing overrides (decode batch
    size, update micro-batch budgets), so their arms run with the preset's own."""
    command = study_readme_from(lease)
    arms, share = re.search(r'ARMS="([^"]+)"', command).group(1), re.search(r"SHARE=([0-9.]+)", command).group(1)
    line = re.search(r"^BENCH=.*$", command, re.M).group(0)  # the lease's command
    sharing = re.search(r"SHARING=(\d)", line).group(1) if "SHARING=" in line else "1"
    assert (lease in ("## Lease 15", "## Lease 16", "## Lease 17")) == (sharing == "0")
    work, study = run_lease_script(tmp_path, BENCH="0", ARMS=arms, STEPS="275", SHARE=share, SHARING=sharing)
    overrides = lease_overrides(study, share, sharing=sharing == "1")
    assert ("generator.batch_size" in overrides) == ("ppo_max_token_len_per_gpu" in overrides) == (sharing == "1")
    log = work / "table2_wm" / "logs"
    assert (log / "gpu_ids").read_text().split() == ["0", "1"][:len(names)]
    assert not (work / "table2_nowm").exists() and not (work / "table2_base").exists()
    recipes = {name: recipe for name, _, recipe in study300_arms()}
    settings = [line for line in (log / "settings").read_text().splitlines() if line]
    assert [line.split()[0] for line in settings] == names
    assert all(line.endswith(overrides) for line in settings)
    assert settings == [f"{name} {' '.join(recipes[name])} {overrides}" for name in names]
    cfg = compose("_2_sokoban", ["model=smollm2-135m", *SWEEP, *recipes[names[-1]], *overrides.split()])
    check_config(cfg)
    assert cfg.ctx_manager.mode == "add_worldmodel" and cfg.algorithm.adv_estimator == estimator
    assert cfg.actor_rollout_ref.actor.use_kl_loss == kl_loss and cfg.trainer.cuda_memory_fraction == float(share) > 0.5
    if sharing == "0":
        budget = compose("_2_sokoban", ["model=smollm2-135m"]).actor_rollout_ref.actor.ppo_max_token_len_per_gpu
        assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == budget  # the preset's, not the sharing 16k


def test_the_lease_script_refuses_a_sharing_other_than_1_or_0(tmp_path):
    """SHARING takes 1 or 0 and nothing else: a one-line error (exit 2) before anything runs."""
    study = REPO / "docs" / "results" / "smollm2_study300"
    refused = subprocess.run(["bash", str(study / "lease.sh")], env={**ENV, "ARMS": "spa_grpo_guard_s4@0",
                                                                     "SHARING": "no"},
                             cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode == 2 and "SHARING takes 1 or 0, got 'no'" in refused.stderr


@pytest.mark.parametrize("lease, placed", [
    ("## Lease 12", [("wm", "0", "spa_grpo_guard_s3"), ("nopred", "1", "nopred_grpo_guard_s1")]),
    ("## Lease 13", [("nopred", "0", "nopred_grpo_guard_s2"), ("nostate", "1", "nostate_grpo_guard_s1")]),
    ("## Lease 14", [("nopred", "0", "nopred_grpo_guard_s3"), ("nostate", "1", "nostate_grpo_guard_s2")])],
    ids=["twelfth", "thirteenth", "fourteenth"])
def test_the_lease_script_runs_its_readmes_own_prompt_ablation_leases_one_sft_and_arm_a_gpu(tmp_path, lease, placed):
    """Leases 12 (as it ran) to 14: two sweeps, each with its own SFT and one arm alone on its GPU with the larger
    share (lease 12: SPA's seed 3 after the world-model SFT, the nopred arm after its SFT; leases 13 and 14: a nopred
    and a nostate arm); every arm composes in add_worldmodel prompts under grpo_guard and passes the PPO checks, and
    no other sweep runs."""
    command = study_readme_from(lease)
    arms, share = re.search(r'ARMS="([^"]+)"', command).group(1), re.search(r"SHARE=([0-9.]+)", command).group(1)
    assert re.search(r"STEPS=(\d+)", command).group(1) == "275"
    work, study = run_lease_script(tmp_path, BENCH="0", ARMS=arms, STEPS="275", SHARE=share)
    overrides = lease_overrides(study, share)
    recipes = {name: recipe for name, _, recipe in study300_arms()}
    for start, gpu, name in placed:
        log = work / f"table2_{start}" / "logs"
        assert (log / "gpu_ids").read_text().split() == [gpu]
        assert (log / "settings").read_text() == f"{name} {' '.join(recipes[name])} {overrides}"
        cfg = compose("_2_sokoban", ["model=smollm2-135m", *SWEEP, *recipes[name], *overrides.split()])
        check_config(cfg)
        assert cfg.ctx_manager.mode == "add_worldmodel" and cfg.algorithm.adv_estimator == "grpo"
        assert cfg.trainer.cuda_memory_fraction == float(share) > 0.5
    others = {"wm", "nowm", "nopred", "nostate", "base"} - {start for start, _, _ in placed}
    assert not any((work / f"table2_{start}").exists() for start in others)


@pytest.mark.parametrize("start, loss_target", [("nopred", "without_prediction"), ("nostate", "without_states")])
def test_an_ablation_sweep_trains_its_sft_on_the_self_play_data_with_its_loss_target_last(tmp_path, start,
                                                                                          loss_target):
    """START=nopred and START=nostate: the SFT reads the world-model data (its rows hold <observation> and
    <prediction> blocks) and its last override is the start's loss target (data.loss_target=without_prediction,
    without_states), after SFT_OVERRIDES; its arms start from that SFT's checkpoint. The stages print their commands
    (SPA_PRINT_STAGE) after the real data stage of the tiny model."""
    out = tmp_path / "sweep"
    checkpoint = out / "sft" / "global_step_2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")  # as if the SFT had saved
    env = {**ENV, "START": start, "MODEL": "tiny", "GPUS": "0", "STEPS": "2", "TEST_FREQ": "1", "OUT": str(out),
           "SPA_PRINT_STAGE": "1", "SFT_OVERRIDES": "data.loss_target=paper",
           "SETTINGS": "a ctx_manager.mode=add_worldmodel trainer.seed=1"}
    subprocess.run(["bash", str(REPO / "benchmarks" / "smollm2_sweep.sh")], env=env, cwd=tmp_path, check=True,
                   capture_output=True, timeout=300)
    sft = (out / "logs" / "sft.log").read_text().split()
    assert f"data.train_files={out}/data/wm_train.parquet" in sft
    assert [arg for arg in sft if arg.startswith("data.loss_target=")] == ["data.loss_target=paper",
                                                                          f"data.loss_target={loss_target}"]
    assert sft[-2] == f"data.loss_target={loss_target}"  # the start's, then only the launcher's preflight
    responses = pq.read_table(out / "data" / "wm_train.parquet", columns=["response"]).column(0).to_pylist()
    assert all("<observation>" in response and "<prediction>" in response for response in responses)
    assert f"model_path={checkpoint}" in (out / "logs" / "a.log").read_text().split()


def test_the_lease_script_runs_its_readmes_eleventh_lease_on_frozen_lake_with_one_sft_a_gpu(tmp_path):
    """Lease 11: CONFIG=_3_frozen_lake through lease.sh to job.sh and the sweeps; the world-model SFT and its two
    arms on GPU 0, the format-only SFT and its two on GPU 1; the arms, with lease.sh's overrides and the length the
    sweep gives SmolLM2 on FrozenLake, compose there and pass the PPO checks."""
    command = study_readme_from("## Lease 11")
    arms, config = re.search(r'ARMS="([^"]+)"', command).group(1), re.search(r"CONFIG=(\w+)", command).group(1)
    assert config == "_3_frozen_lake" and re.search(r"BENCH=(\d)", command).group(1) == "0"
    work, study = run_lease_script(tmp_path, BENCH="0", ARMS=arms, STEPS="275", CONFIG=config)
    assert "config=_3_frozen_lake gpus=2" in (work / "out" / "progress.txt").read_text()
    overrides = lease_overrides(study, share="0.3")
    placed = {"wm": (["0", "0"], ["grpo_guard", "grpo_guard_s1"]),
              "nowm": (["1", "1"], ["format_grpo_guard", "format_grpo_guard_s1"])}
    recipes = {name: overrides for name, _, overrides in study300_arms()}
    length = re.search(r"_3_frozen_lake:smollm2-135m \] && PPO\+=\((actor_rollout_ref\.rollout\.response_length=\d+)\)",
                       (REPO / "benchmarks" / "smollm2_sweep.sh").read_text())[1]  # the sweep's FrozenLake length
    for start, (gpus, names) in placed.items():
        log = work / f"table2_{start}" / "logs"
        assert (log / "gpu_ids").read_text().split() == gpus
        settings = [line for line in (log / "settings").read_text().splitlines() if line]
        assert [line.split()[0] for line in settings] == names
        assert all(line.endswith(overrides) for line in settings)
        for name in names:
            cfg = compose(config, ["model=smollm2-135m", *SWEEP, *recipes[name], *overrides.split(), length])
            check_config(cfg)
            assert cfg.es_manager.format_penalty == -0.25 and cfg.ctx_manager.mode == "base"
    assert not (work / "table2_base").exists()


def test_the_lease_script_times_issue_42s_benchmarks_side_by_side_before_the_arms(tmp_path):
    """BENCH=1 on two GPUs: the SFT epoch alone on GPU 0 with the preset's SFT settings and one epoch, the 0.5B step
    on GPU 1, both under their time limits and both ended before the arms' sweeps start; progress.txt says each."""
    work, _ = run_lease_script(tmp_path, ARMS="grpo_guard_s4@0 format_grpo_guard_s4@1")
    gpu, limit, sft_only, sft = (work / "out" / "b42" / "env").read_text().split(" ", 3)
    assert (gpu, limit, sft_only) == ("0", "240", "1") and sft.split()[-1] == "trainer.total_epochs=1"
    assert "trainer.total_epochs=2" in sft  # the preset's, which the one epoch follows and overrides
    assert (work / "out" / "ppo_env").read_text() == "1"
    progress = (work / "out" / "progress.txt").read_text()
    assert "bench: smollm2_step.sh rc=0 sft 55.0 0;" in progress
    assert 'bench: ppo_0.5b on GPU 1 rc=0 "seconds": 19.5' in progress
    assert progress.index("bench: ppo_0.5b") < progress.index("config=_2_sokoban")
    assert progress.index("bench: smollm2_step.sh rc") < progress.index("config=_2_sokoban")
    assert (work / "table2_wm" / "logs" / "gpu_ids").read_text().split() == ["0"]


def test_the_lease_scripts_0_5b_step_runs_with_smollm2s_speed_settings_or_else_the_defaults(tmp_path):
    """Issue 42 asks for the 0.5B shape's step "with the same changes": every override lease.sh gives it is the
    SmolLM2 preset's value, and so are its token budgets; if that run fails, the defaults' run follows."""
    work, _ = run_lease_script(tmp_path, ARMS="grpo_guard_s4@0")
    args = json.loads((work / "out" / "ppo_args").read_text())
    preset = compose("_2_sokoban", ["model=smollm2-135m"])
    overrides = args[args.index("--override") + 1:]
    assert len(overrides) == 8
    for override in overrides:
        key, value = override.split("=")
        assert str(OmegaConf.select(preset, key)) == value, key
    assert int(args[args.index("--budget") + 1]) == preset.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    assert int(args[args.index("--forward-budget") + 1]) == preset.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu
    work, _ = run_lease_script(tmp_path / "failing", ARMS="grpo_guard_s4@0", PPO_STEP_FAILS="1")
    runs = [json.loads(line) for line in (work / "out" / "ppo_args").read_text().splitlines()]
    assert "--override" in runs[0] and runs[1] == ["--model", "0.5b", "--repeats", "3", "--json",
                                                   str(work / "out" / "ppo_0.5b_defaults.json")]
    progress = (work / "out" / "progress.txt").read_text()
    assert "speed settings on GPU 1 rc=1; with the defaults" in progress
    assert 'bench: ppo_0.5b_defaults on GPU 1 rc=0 "seconds": 19.5' in progress


def test_a_sweep_with_wait_for_is_ready_after_its_stages_then_adds_the_gate_after_each_arms_overrides(tmp_path):
    out, gate = tmp_path / "sweep", tmp_path / "gate.txt"
    (out / "ppo" / "_2_sokoban" / "a" / "global_step_2" / "actor").mkdir(parents=True)  # as if the arm had saved
    env = {**ENV, "START": "base", "MODEL": "tiny", "GPUS": "0", "STEPS": "2", "TEST_FREQ": "1", "OUT": str(out),
           "WAIT_FOR": str(gate), "SPA_PRINT_STAGE": "1",  # the arms print their PPO command instead of running
           # one arm (each costs two python starts before and two after the gate); {data}: the SFT data's folder
           "SETTINGS": "a trainer.seed=1 actor_rollout_ref.actor.sft_aux_files={data}/wm_train.parquet"}
    sweep = subprocess.Popen(["bash", str(REPO / "benchmarks" / "smollm2_sweep.sh")], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (out / "logs" / "ready").exists():
        assert sweep.poll() is None, sweep.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert (out / "logs" / "ready").read_text() == "tiny\n"  # the arms' starting model (START=base)
    time.sleep(0.5)
    assert sweep.poll() is None and not (out / "logs" / "a.log").exists()  # waiting for the gate
    gate.write_text("agent_proxy.pipeline_turns=true\n")
    assert sweep.wait(timeout=60) == 0, sweep.stdout.read()
    command = (out / "logs" / "a.log").read_text().split()
    assert command[-3:] == ["trainer.seed=1", f"actor_rollout_ref.actor.sft_aux_files={out}/data/wm_train.parquet",
                            "agent_proxy.pipeline_turns=true"]  # the gate's after the setting's overrides
    stages = [line.split(" ", 1)[1] for line in (out / "logs" / "stages.txt").read_text().splitlines()]
    assert stages == ["checks done", "arms start"]  # no conversion (tiny), data or SFT (START=base)
    assert not (out / "wm_eval").exists()  # WM_EVAL is off by default: no evaluation of the arm's checkpoint


def test_wm_eval_plays_each_runs_last_checkpoint_in_the_sfts_own_prompts(tmp_path):
    """WM_EVAL=1: a run's newest checkpoint (by step, not by name) is evaluated in add_worldmodel prompts on the
    validation puzzles × VAL_SAMPLES; a run without a checkpoint is not. The arms and the evaluation print their
    commands (SPA_PRINT_STAGE), so no model runs."""
    out = tmp_path / "sweep"
    for step in (2, 10):
        (out / "ppo" / "_2_sokoban" / "a" / f"global_step_{step}" / "actor").mkdir(parents=True)
    env = {**ENV, "START": "base", "MODEL": "tiny", "GPUS": "0", "STEPS": "2", "TEST_FREQ": "1", "OUT": str(out),
           "WM_EVAL": "1", "SPA_PRINT_STAGE": "1", "SETTINGS": "a trainer.seed=1\nb trainer.seed=2"}
    subprocess.run(["bash", str(REPO / "benchmarks" / "smollm2_sweep.sh")], env=env, cwd=tmp_path, check=True,
                   capture_output=True, timeout=120)
    assert sorted(path.name for path in (out / "wm_eval").iterdir()) == ["a.log"]  # b saved no checkpoint
    command = (out / "wm_eval" / "a.log").read_text().split()
    assert command[:5] == ["python", "-m", "SPA_agent.evaluate", "--config-name", "_2_sokoban"]
    assert command[5:] == ["model=tiny", f"model_path={out}/ppo/_2_sokoban/a/global_step_10/actor",
                           "evaluation.prompt_mode=add_worldmodel", "evaluation.n=4", "evaluation.overwrite=true",
                           "evaluation.write_trajectories=false", "evaluation.write_plots=false",
                           f"evaluation.output_dir={out}/wm_eval/a"]
    cfg = prepare_eval_config(compose("_2_sokoban", command[5:]), "_2_sokoban")
    assert cfg.ctx_manager.mode == "add_worldmodel"  # the states written, and scored, in every turn
    validation = compose("_2_sokoban", ["model=tiny", *SWEEP]).es_manager.val
    assert (cfg.es_manager.val.env_groups, cfg.es_manager.val.group_size) == (validation.env_groups, 4)


SWEEP_STUB = """#!/usr/bin/env bash
# smollm2_sweep.sh's WAIT_FOR protocol alone: ready after the SFT (none here), then the gate's overrides
mkdir -p "$OUT/logs"
[ "$START" = "${FAIL:-}" ] && exit 3
echo "$GPU_IDS" > "$OUT/logs/gpu_ids"
printf '%s' "$SETTINGS" > "$OUT/logs/settings"
echo "$WM_EVAL" > "$OUT/logs/wm_eval"
echo "$STEPS" > "$OUT/logs/steps"
if [ -n "${BENCH_MARK:-}" ]; then  # whether the kernels' benchmark had ended when this sweep started
    if [ -e "$BENCH_MARK" ]; then echo after; else echo before; fi > "$OUT/logs/started_bench"
fi
if [ -n "${MARK:-}" ]; then  # an SFT that lasts until the GPU tests have run (at most 10 s)
    for _ in $(seq 100); do [ -e "$MARK" ] && break; sleep 0.1; done
    [ -e "$MARK" ] && echo "$START" > "$OUT/logs/tests_ran_during_sft"
fi
echo "$OUT/sft/global_step_2" > "$OUT/logs/ready"
[ -n "$WAIT_FOR" ] || exit 0  # GATE=off
while [ ! -e "$WAIT_FOR" ]; do sleep 0.1; done
cp "$WAIT_FOR" "$OUT/logs/gate_seen"
"""
STEP_STUB = """import json, os, sys
args = sys.argv[1:]
name = os.path.basename(args[args.index("--json") + 1])[len("gate_"):-len(".json")]
open(os.environ["STEP_ARGS"] + name, "w").write(json.dumps(args))
open(os.environ["STEP_ARGS"] + name + ".gpu", "w").write(os.environ["CUDA_VISIBLE_DEVICES"])
total = float(os.environ["TOTAL_" + name])
if total < 0:
    sys.exit(1)  # a failed benchmark
summary = {"metric": "summary", "timing_s/gen": total - 1, "total": total}
open(args[args.index("--json") + 1], "w").write(json.dumps([summary]))
"""


def stub_tree(tmp_path: Path) -> Path:
    """tmp_path/repo: a copy of this lease's folder beside a stub of the sweep (benchmarks/smollm2_sweep.sh)."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True, exist_ok=True)
    shutil.copytree(HERE, repo / "docs" / "results" / "smollm2_table2", ignore=shutil.ignore_patterns("lease*"))
    (repo / "benchmarks" / "smollm2_sweep.sh").write_text(SWEEP_STUB)
    return repo


def run_job(tmp_path: Path, **env: str) -> tuple[Path, Path]:
    """job.sh with GATE=pipeline in a copy of the tree whose sweep and step benchmark are stubs; (work dir, out/)."""
    repo, work = stub_tree(tmp_path), tmp_path / "work"
    (repo / "benchmarks" / "smollm2_step.py").write_text(STEP_STUB)
    env = {**ENV, "MODEL": "tiny", "REPO": str(repo), "WORK": str(work), "ARMS": "spa_s0 format_s0 vanilla_s0",
           "STEP_ARGS": str(tmp_path / "step_args_"), **env}
    job = subprocess.run(["bash", str(repo / "docs" / "results" / "smollm2_table2" / "job.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    return work, work / "out"


def with_gpus(tmp_path: Path, count: int) -> str:
    """A PATH whose `nvidia-smi --list-gpus` names `count` H200s (job.sh counts the host's GPUs with it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    listing = "".join(f"GPU {i}: H200\\n" for i in range(count))
    (bin_dir / "nvidia-smi").write_text(f'#!/usr/bin/env bash\nprintf "{listing}"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    return f"{bin_dir}{os.pathsep}{ENV['PATH']}"


#: the gate's variants in these tests (GATE_VARIANTS): the baseline first
VARIANTS = {"base_line": "", "fast_a": "agent_proxy.pipeline_turns=true",
            "fast_b": "critic.ppo_max_token_len_per_gpu=32768"}


def run_gated_job(tmp_path: Path, totals: tuple[float, float, float], **env: str) -> tuple[Path, Path]:
    """run_job with VARIANTS as the gate's variants, each benchmark's step taking its `totals` seconds (< 0: fails)."""
    variants = tmp_path / "variants.txt"
    variants.write_text("# a comment line\n" + "".join(f"{name} {overrides}\n" for name, overrides in VARIANTS.items()))
    return run_job(tmp_path, GATE_VARIANTS=str(variants),
                   **{f"TOTAL_{name}": str(total) for name, total in zip(VARIANTS, totals)}, **env)


@pytest.mark.parametrize("totals, chosen", [((10.0, 9.0, 9.5), "fast_a"), ((10.0, 9.5, 8.0), "fast_b"),
                                           ((10.0, 9.5, 9.2), "base_line"), ((10.0, -1, 8.5), "fast_b"),
                                           ((-1, 5.0, 5.0), None)],
                         ids=["a_10pc_less", "b_fastest", "none_10pc_less", "a_fails", "baseline_fails"])
def test_the_gate_gives_every_arm_the_fastest_variant_if_its_step_takes_at_least_10_percent_less(tmp_path, totals,
                                                                                                chosen):
    work, out = run_gated_job(tmp_path, totals)
    gate = VARIANTS.get(chosen, "")
    assert (work / "gate.txt").read_text() == gate + "\n"
    for start in ("wm", "nowm", "base"):
        assert (work / f"table2_{start}" / "logs" / "gate_seen").read_text() == gate + "\n"
    for name, overrides in VARIANTS.items():
        args = json.loads((tmp_path / f"step_args_{name}").read_text())
        assert args[args.index("--model-path") + 1] == str(work / "table2_wm" / "sft" / "global_step_2")
        assert "ctx_manager.mode=add_worldmodel" in args and "critic.optim.lr=1e-4" in args
        assert args[len(args) - len(overrides.split()):] == overrides.split()  # the variant's overrides come last
    progress = (out / "progress.txt").read_text()
    decision = [line for line in progress.splitlines() if "gate: a step" in line]
    assert len(decision) == 1
    assert decision[0].endswith(f": {chosen}" if chosen else ": no timing of the baseline (base_line), so the baseline")
    for name, total in zip(VARIANTS, totals):
        assert (f"{name} {total} s" in decision[0]) == (total >= 0)
        assert (f"the step benchmark failed ({name}, rc=1, GPU 0): left out" in progress) == (total < 0)


def test_the_default_variants_compose_for_the_spa_arm_and_the_baseline_is_the_config(tmp_path):
    lines = [line.split() for line in (HERE / "gate_variants.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == ["default"]
    spa = next(overrides for name, _, overrides in arms() if name == "spa_s0")
    for _, *overrides in lines:
        check_config(compose("_2_sokoban", ["model=smollm2-135m", *SWEEP, *spa, *overrides]))


@pytest.mark.parametrize("gpu_test", ["passes", "fails", "no_gpu"])
def test_a_reused_prefix_cache_variant_is_timed_only_after_its_gpu_test_passed(tmp_path, gpu_test):
    """However fast, a suffix kernel that computes the wrong attention must not reach the arms."""
    repo = tmp_path / "repo"
    (repo / "tests" / "generators").mkdir(parents=True)
    (repo / "tests" / "generators" / "test_reused_prefix_cache.py").write_text(
        f"def test_gpu_suffix():\n    assert {gpu_test == 'passes'}\n")
    variants = tmp_path / "variants.txt"
    variants.write_text("base_line\nreuse generator.reuse_prefix_cache=true\n")
    path = with_gpus(tmp_path, 1) if gpu_test != "no_gpu" else ENV["PATH"]
    work, out = run_job(tmp_path, GATE_VARIANTS=str(variants), TOTAL_base_line="10", TOTAL_reuse="5", PATH=path,
                        KERNEL_BENCH="1")
    timed = (tmp_path / "step_args_reuse").exists()
    assert timed == (gpu_test == "passes")
    assert (work / "gate.txt").read_text() == ("generator.reuse_prefix_cache=true\n" if timed else "\n")
    progress = (out / "progress.txt").read_text()
    assert f"the GPU test of generator.reuse_prefix_cache=true {'passed' if timed else 'failed'}" in progress
    assert ("reuse left out: a GPU test its overrides need did not pass" in progress) == (not timed)
    assert (out / "gate_gpu_test_test_reused_prefix_cache.log").exists() == (gpu_test != "no_gpu")
    # the kernels' benchmark runs on the one GPU (absent from this tree: rc 2), not without a GPU
    assert ("the decode attention kernels' benchmark rc=2" in progress) == (gpu_test != "no_gpu")


def test_the_gpu_tests_run_while_the_sft_is_made_and_the_decoders_for_the_record(tmp_path):
    """The GPU tests start with the sweeps (on the last GPU), not after the SFT: the stub SFT lasts until they ran."""
    repo, mark = tmp_path / "repo", tmp_path / "gpu_tests_ran"
    (repo / "tests" / "generators").mkdir(parents=True)
    bench = tmp_path / "kernel_bench_ran"
    (repo / "tests" / "generators" / "test_fused_projections.py").write_text(  # after the kernels' benchmark
        f"import os\ndef test_gpu_fused():\n    open({str(mark)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'] + "
        f"open({str(bench)!r}).read())\n")
    (repo / "benchmarks").mkdir()
    (repo / "benchmarks" / "decode_attention_kernels.py").write_text(
        f"import os, sys\nopen({str(bench)!r}, 'w').write(' bench on ' + os.environ['CUDA_VISIBLE_DEVICES'] + ' '"
        f" + ' '.join(sys.argv[1:]))\n")
    (repo / "tests" / "generators" / "test_static_decode.py").write_text("def test_gpu_decoder():\n    assert False\n")
    variants = tmp_path / "variants.txt"
    variants.write_text("base_line\nfused generator.fused_projections=true\n")
    work, out = run_job(tmp_path, ARMS="spa_s0", GATE_VARIANTS=str(variants), TOTAL_base_line="10", TOTAL_fused="5",
                        MARK=str(mark), KERNEL_BENCH="1", PATH=with_gpus(tmp_path, 2))
    assert (work / "table2_wm" / "logs" / "tests_ran_during_sft").read_text() == "wm\n"
    # the last GPU (the wm sweep's SFT is on GPU 0), after the kernels' benchmark there
    assert mark.read_text() == f"1 bench on 1 --json {out / 'decode_attention.jsonl'}"
    assert (work / "gate.txt").read_text() == "generator.fused_projections=true\n"
    progress = (out / "progress.txt").read_text()
    assert "gate: the GPU test of generator.fused_projections=true passed: 1 passed" in progress
    # the decoder's tests ran too, on the last GPU; their failure is reported and gates nothing
    assert "the GPU tests of tests/generators/test_static_decode.py (the decoder every arm uses; they gate nothing) " \
           "failed: 1 failed" in progress
    assert (out / "gate_gpu_test_test_static_decode.result").read_text() == "failed\n"
    assert "the decode attention kernels' benchmark rc=0" in progress


def test_gate_profile_goes_to_the_baseline_benchmark_alone(tmp_path):
    run_gated_job(tmp_path, (10.0, 10.0, 10.0), GATE_PROFILE="--profile gen")
    for name in VARIANTS:
        args = json.loads((tmp_path / f"step_args_{name}").read_text())
        assert ("--profile" in args and args[args.index("--profile") + 1] == "gen") == (name == "base_line")


@pytest.mark.parametrize("arms, gpu_ids", [
    ("spa_s1 spa_s2 format_s1 format_s2", {"wm": "0 1", "nowm": "1 0"}),  # the two SFTs on GPUs 0 and 1
    ("", {"wm": "0 1", "nowm": "1", "base": "0"}),  # the first 2 x 2 arms
    ("spa_s0 format_s0@1 format_s1@1", {"wm": "0", "nowm": "1 1"}),  # SPA alone, the format-only seeds beside it
    ("spa_s0@1 spa_s1@1 format_s0@0", {"wm": "1 1", "nowm": "0"}),
], ids=["seeds_1_2", "default_four", "placed", "placed_swapped"])
def test_two_gpus_take_the_arms_round_robin_and_the_two_sfts_one_each(tmp_path, arms, gpu_ids):
    work, _ = run_gated_job(tmp_path, (10.0, 10.0, 10.0), ARMS=arms, PATH=with_gpus(tmp_path, 2))
    assert {start: (work / f"table2_{start}" / "logs" / "gpu_ids").read_text().strip()
            for start in ("wm", "nowm", "base") if (work / f"table2_{start}").exists()} == gpu_ids
    # the gate's variants side by side, variant k on GPU k mod 2
    assert [(tmp_path / f"step_args_{name}.gpu").read_text() for name in VARIANTS] == ["0", "1", "0"]


@pytest.mark.parametrize("arms, message", [
    ("spa_s0 format_s0@2", "error: ARMS: 'format_s0@2' names GPU 2, but this host has 2 (0-1)"),
    ("spa_s0@ format_s0", "error: ARMS: 'spa_s0@' takes a GPU's number after the @"),
    ("spa_s0@one", "error: ARMS: 'spa_s0@one' takes a GPU's number after the @"),
    ("spa_s9@0", "error: ARMS names 'spa_s9', not an arm of"),
])
def test_a_bad_placement_is_one_line_and_exit_status_2(tmp_path, arms, message):
    job = subprocess.run(["bash", str(HERE / "job.sh")], capture_output=True, text=True, timeout=30,
                         env={**ENV, "MODEL": "tiny", "REPO": str(REPO), "WORK": str(tmp_path), "ARMS": arms,
                              "PATH": with_gpus(tmp_path, 2)})
    assert job.returncode == 2
    assert job.stderr.startswith(message) and job.stderr.count("\n") == 1


def test_without_the_gate_the_decoders_gpu_tests_still_run_and_the_benchmarks_gpu_waits_for_it(tmp_path):
    """GATE=off: the decoder's and the gate variants' GPU tests run for the record after the kernels' benchmark (with
    KERNEL_BENCH_ARGS) on the last GPU; the sweep whose SFT is on that GPU starts once the benchmark has ended, the
    one on GPU 0 at once."""
    repo, bench_mark = tmp_path / "repo", tmp_path / "bench_ended"
    (repo / "tests" / "generators").mkdir(parents=True)
    for name in ("test_static_decode", "test_shared_prefix_decode", "test_fused_projections", "test_compact_decode"):
        (repo / "tests" / "generators" / f"{name}.py").write_text("def test_gpu():\n    assert True\n")
    (repo / "benchmarks").mkdir()
    (repo / "benchmarks" / "decode_attention_kernels.py").write_text(
        f"import sys, time\ntime.sleep(2)\nopen({str(bench_mark)!r}, 'w').write(' '.join(sys.argv[1:]))\n")
    work, out = run_job(tmp_path, GATE="off", ARMS="spa_s0 format_s0@1", KERNEL_BENCH="1",
                        KERNEL_BENCH_ARGS="--finished 0.6 0.9", BENCH_MARK=str(bench_mark), PATH=with_gpus(tmp_path, 2))
    assert bench_mark.read_text() == f"--json {out / 'decode_attention.jsonl'} --finished 0.6 0.9"
    assert (work / "table2_wm" / "logs" / "started_bench").read_text() == "before\n"
    assert (work / "table2_nowm" / "logs" / "started_bench").read_text() == "after\n"
    assert not (work / "gate.txt").exists() and not list(tmp_path.glob("step_args_*"))  # no gate
    progress = (out / "progress.txt").read_text()
    assert "the decode attention kernels' benchmark rc=0" in progress
    for name in ("test_static_decode", "test_shared_prefix_decode", "test_fused_projections"):
        assert f"the GPU tests of tests/generators/{name}.py (the decoder every arm uses; they gate nothing) " \
               "passed: 1 passed" in progress
    # the gate's variants' tests too, for the record (gate_variants.txt: compact16 and plain_decode; the latter's
    # test file is absent from this tree)
    assert "the GPU tests of tests/generators/test_compact_decode.py (a gate variant's; no gate here, for the " \
           "record) passed: 1 passed" in progress
    assert "the GPU tests of tests/generators/test_split_kv_decode.py (a gate variant's; no gate here, for the " \
           "record) failed: tests/generators/test_split_kv_decode.py: no such test file in this tree" in progress


def test_the_gate_is_empty_without_timing_when_the_wm_sweep_fails(tmp_path):
    work, out = run_job(tmp_path, FAIL="wm")
    assert (work / "gate.txt").read_text() == ""
    assert (work / "table2_base" / "logs" / "gate_seen").read_text() == ""
    assert not list(tmp_path.glob("step_args_*"))
    assert "the wm sweep exited before its SFT was done" in (out / "progress.txt").read_text()


RELAY_SWEEP_STUB = """#!/usr/bin/env bash
# the WAIT_FOR protocol of SWEEP_STUB after an SFT checkpoint (SFT_BYTES: its weights); after the gate each arm's
# run: carried in (its step recorded) or new, with a checkpoint of one more step
mkdir -p "$OUT/logs" "$OUT/sft/global_step_2"
printf '%s' "${SFT_BYTES:-same}" > "$OUT/sft/global_step_2/model.safetensors"
echo "$RESUME $SAVE_FREQ $SFT_OVERRIDES" > "$OUT/logs/resume_and_sft"
echo "$OUT/sft/global_step_2" > "$OUT/logs/ready"
while [ ! -e "$WAIT_FOR" ]; do sleep 0.1; done
cp "$WAIT_FOR" "$OUT/logs/gate_seen"
while read -r name rest; do
    run="$OUT/ppo/_2_sokoban/$name"
    step=$(cat "$run/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
    echo "$step" > "$OUT/logs/$name.found_step"
    step=$(( step + 1 ))
    mkdir -p "$run/global_step_$step"
    echo "{}" > "$run/run_identity.json"; echo "{\\"step\\": $step}" >> "$run/metrics.jsonl"
    printf 'actor_rollout_ref:\\n  model:\\n    path: %s\\n' "$OUT/sft/global_step_2" > "$run/config.yaml"
    echo state > "$run/global_step_$step/trainer_state.pt"; echo "$step" > "$run/latest_checkpointed_iteration.txt"
done <<< "$SETTINGS"
"""


def run_relay_lease(tmp_path: Path, lease: str, relay_in: Path | None = None, **env: str) -> tuple[Path, str]:
    """One relay lease of job.sh (DEADLINE in 1000 s) over stub sweeps in tmp_path/work, as on a fresh machine,
    then moved to tmp_path/<lease> (the next lease's runs begin where this one's did); (its directory, progress)."""
    repo, work = tmp_path / "repo", tmp_path / "work"
    if not repo.exists():
        (repo / "benchmarks").mkdir(parents=True)
        shutil.copytree(HERE, repo / "docs" / "results" / "smollm2_table2", ignore=shutil.ignore_patterns("lease*"))
        shutil.copytree(HERE.parent / "smollm2_relay", repo / "docs" / "results" / "smollm2_relay")
        (repo / "benchmarks" / "smollm2_sweep.sh").write_text(RELAY_SWEEP_STUB)
        (repo / "SPA_agent").symlink_to(REPO / "SPA_agent")  # python -m SPA_agent.runs.relay from the copy
    if relay_in is not None:
        shutil.copytree(relay_in, work / "relay_in")
    env = {**ENV, "MODEL": "tiny", "REPO": str(repo), "WORK": str(work), "GATE": "off",
           "ARMS_FILE": str(repo / "docs" / "results" / "smollm2_relay" / "arms.txt"),
           "ARMS": "spa_lora format_lora", "DEADLINE": str(int(time.time()) + 1000), **env}
    job = subprocess.run(["bash", str(repo / "docs" / "results" / "smollm2_table2" / "job.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    work.rename(tmp_path / lease)
    return tmp_path / lease, (tmp_path / lease / "out" / "progress.txt").read_text()


@pytest.mark.slow
def test_a_relay_lease_packs_its_runs_and_the_next_continues_them_over_the_same_sft(tmp_path):
    work, progress = run_relay_lease(tmp_path, "lease1")
    assert "relay: nothing carried in" in progress
    for start, name in (("wm", "spa_lora"), ("nowm", "format_lora")):
        logs = work / f"table2_{start}" / "logs"
        assert (logs / f"{name}.found_step").read_text() == "0\n"
        assert (logs / "resume_and_sft").read_text().split() == ["1", "25", "trainer.deterministic=true"]
        gate = (logs / "gate_seen").read_text().split()
        assert len(gate) == 1 and 840 <= int(gate[0].removeprefix("trainer.max_wall_s=")) <= 850  # 1000 s - 150
    assert "relay: packed" in progress and (work / "relay_out" / "relay.json").exists()
    out = tmp_path / "returned"
    out.mkdir()
    collect = subprocess.run(["bash", str(HERE / "relay_collect.sh"), "0"], capture_output=True, text=True,
                             env={**ENV, "OUT": str(out), "RELAY_OUT": str(work / "relay_out")})
    assert collect.returncode == 0 and "1 parts, 1 calls" in collect.stdout, collect.stderr
    assert sorted(p.name for p in out.iterdir()) == ["relay.json", "relay.tar.000"]

    work2, progress2 = run_relay_lease(tmp_path, "lease2", relay_in=out)  # another machine: same SFT bytes
    assert "relay: carried in: " in progress2
    assert (work2 / "table2_wm" / "logs" / "spa_lora.found_step").read_text() == "1\n"
    assert (work2 / "table2_nowm" / "logs" / "format_lora.found_step").read_text() == "1\n"
    assert [r["step"] for r in json.loads((work2 / "relay_out" / "relay.json").read_text())["runs"]] == [2, 2]

    work3, progress3 = run_relay_lease(tmp_path, "lease3", relay_in=out, SFT_BYTES="other")  # an SFT not remade
    assert "relay: NOT carried in, every arm starts at step 0" in progress3 and "other weights" in progress3
    assert (work3 / "table2_wm" / "logs" / "spa_lora.found_step").read_text() == "0\n"


def test_a_relay_needs_the_gate_off(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(HERE, repo / "docs" / "results" / "smollm2_table2", ignore=shutil.ignore_patterns("lease*"))
    job = subprocess.run(["bash", str(repo / "docs" / "results" / "smollm2_table2" / "job.sh")],
                         env={**ENV, "REPO": str(repo), "WORK": str(tmp_path), "DEADLINE": "1", "GATE": "pipeline"},
                         capture_output=True, text=True, timeout=60)
    assert job.returncode == 2 and "needs GATE=off" in job.stderr


def relay_arms() -> list[tuple[str, str, list[str]]]:
    path = HERE.parent / "smollm2_relay" / "arms.txt"
    lines = [line.split() for line in path.read_text().splitlines() if line and line[0] != "#"]
    return [(name, start, overrides) for name, start, *overrides in lines]


@pytest.mark.parametrize("name, start, overrides", relay_arms(), ids=[a[0] for a in relay_arms()])
def test_each_relay_arm_trains_slim_lora_roles_and_passes_the_ppo_checks(name, start, overrides):
    cfg = compose("_2_sokoban", ["model=smollm2-135m", *SWEEP, *overrides])
    check_config(cfg)
    assert cfg.ctx_manager.mode == ("base" if start == "nowm" else "add_worldmodel")
    assert cfg.actor_rollout_ref.model.lora_rank == cfg.critic.model.lora_rank == 8
    assert cfg.trainer.save_merged_lora is False  # what a lease can carry: adapters and optimizer state
    assert cfg.algorithm.adv_estimator == ("grpo" if name.endswith("grpo") else "gae")

"""benchmarks/table2_rows.py: issue 43's Table 2 rows, seeds pooled, compared at the step every arm reached."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "table2_rows.py"


def write_arm(directory: Path, name: str, success: dict[int, float], prediction: dict[int, float] | None = None,
              observation: dict[int, float] | None = None):
    records = []
    for step in range(max(success) + 1):
        record = {"step": step, "train/SimpleSokoban/success": 0.1}
        if step in success:
            record["val-env/SimpleSokoban/success"] = success[step]
        if prediction and step in prediction:
            record["val-env/SimpleSokoban/worldmodel/prediction_exact"] = prediction[step]
        if observation and step in observation:
            record["val-env/SimpleSokoban/worldmodel/observation_exact"] = observation[step]
        records.append(record)
    (directory / name).mkdir(parents=True)
    (directory / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_rows_pool_their_seeds_at_the_last_step_every_arm_reached(tmp_path):
    wm, nowm = tmp_path / "lease1" / "wm", tmp_path / "lease2" / "nowm"
    write_arm(wm, "spa_s0", {0: 0.2, 25: 0.25, 50: 0.35}, prediction={0: 0.3, 25: 0.2, 50: 0.1},
              observation={0: 1.0, 25: 0.9, 50: 0.8})
    write_arm(wm, "spa_s1", {0: 0.2, 25: 0.35}, prediction={0: 0.2, 25: 0.1}, observation={0: 0.98, 25: 0.96})
    write_arm(nowm, "format_s0", {0: 0.2, 25: 0.2, 50: 0.2, 75: 0.2})
    done = run(wm, nowm, "--val-episodes", "512")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("| row | seeds | step 0 | step 25 |")  # spa_s1 stopped at step 25
    # spa at 25: mean 0.300 over 2 x 512 episodes, Wilson [0.273, 0.329]; at 0: 0.200 over 1024, [0.177, 0.226]
    assert lines[2] == ("| spa | 2 | 0.200 [0.177, 0.226] | 0.300 [0.273, 0.329] | +0.100 | 0.250, 0.350 "
                        "| 0.990 → 0.930 | 0.250 → 0.150 |")
    assert lines[3] == "| format | 1 | 0.200 [0.168, 0.237] | 0.200 [0.168, 0.237] | +0.000 | 0.200 |  |  |"


def test_a_chosen_step_names_the_arms_that_have_not_reached_it(tmp_path):
    write_arm(tmp_path, "spa_s0", {0: 0.2, 25: 0.25, 50: 0.35})
    write_arm(tmp_path, "spa_s1", {0: 0.2, 25: 0.35})
    done = run(tmp_path, "--step", "50")
    assert done.returncode == 0, done.stderr
    assert "| spa | 1 | 0.200 [0.168, 0.237] | 0.350 [0.310, 0.392] | +0.150 | 0.350 |  |  |" in done.stdout
    assert done.stdout.strip().endswith("not validated at step 50: spa_s1")


def test_a_step_no_arm_validated_is_a_one_line_error_that_lists_the_validation_steps(tmp_path):
    write_arm(tmp_path, "spa_s0", {0: 0.2, 25: 0.25, 50: 0.35})
    write_arm(tmp_path, "format_s0", {0: 0.2, 25: 0.2})
    for extra in ([], ["--count-stopped"]):
        done = run(tmp_path, "--step", "30", *extra)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.strip() == "error: no arm validated at step 30 (the arms' validation steps: 0, 25, 50)"


def test_no_arms_is_a_one_line_error(tmp_path):
    done = run(tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == f"error: no <arm>/metrics.jsonl under {tmp_path}"


def test_onset_is_where_success_rises_to_the_level_and_stays_there(tmp_path):
    write_arm(tmp_path, "spa_s0", {0: 0.1, 25: 0.3, 50: 0.2, 75: 0.3, 100: 0.4})  # a dip at 50: from 75 on
    write_arm(tmp_path, "spa_s1", {0: 0.1, 25: 0.3, 50: 0.35})
    write_arm(tmp_path, "format_s0", {0: 0.2, 25: 0.2, 50: 0.24})  # never there
    done = run(tmp_path, "--onset", "0.25")
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("| row | arm | onset: success ≥ 0.250 from | last validation |\n|---|---|---|---|\n"
                                "| format | format_s0 | — | 50 |\n"  # (the arms in their folders' order)
                                "| spa | spa_s0 | 75 | 100 |\n| spa | spa_s1 | 25 | 50 |\n")


def test_t_quantiles_are_the_textbooks():
    sys.path.insert(0, str(SCRIPT.parent))
    import table2_rows

    quantiles = {1: 12.7062, 2: 4.3027, 5: 2.5706, 10: 2.2281, 30: 2.0423, 10_000: 1.9602}  # t_{0.975, df}
    assert {df: round(table2_rows.t_quantile(0.975, df), 4) for df in quantiles} == quantiles
    assert round(table2_rows.t_quantile(0.95, 4), 4) == 2.1318


def test_compare_gives_the_seeds_welch_interval_and_exact_permutation_test(tmp_path):
    for seed, (spa, fmt) in enumerate([(0.45, 0.35), (0.38, 0.31), (0.37, 0.35)]):
        write_arm(tmp_path, f"spa_s{seed}", {0: 0.0, 25: spa})
        write_arm(tmp_path, f"format_s{seed}", {0: 0.2, 25: fmt})
    done = run(tmp_path, "--compare", "spa", "format")
    assert done.returncode == 0, done.stderr
    # difference 0.4 - 0.33667 = 0.06333; variances 0.0019 and 0.000533 over 3 seeds each: SE 0.02848, Welch's df
    # 0.0008111^2 / (0.0006333^2 / 2 + 0.0001778^2 / 2) = 3.04, t_{0.975, 3.04} = 3.158: half-width 0.0900;
    # all three spa seeds above all three format ones: one split of 20 as extreme (one-sided), two (two-sided)
    assert done.stdout.splitlines()[-2] == (
        "spa − format at step 25, over seeds (3 and 3): +0.063, Welch 95% interval [-0.027, +0.153] (df 3.0); "
        "exact permutation test of the seeds: one-sided p = 0.050, two-sided p = 0.100")
    # z_{0.975} + z_{0.80} = 2.8016: detectable 2.8016 * 0.02848 = 0.0798; seeds a row for the observed 0.0633,
    # 2.8016^2 * (0.0019 + 0.000533) / 0.0633^2 = 4.76, so 5
    assert done.stdout.splitlines()[-1] == (
        "power over seeds (80%, two-sided 5%, normal approximation): at 3 and 3 seeds a difference of 0.080 is found; "
        "the observed 0.063 needs 5 seeds a row")
    # one seed in a row: no variance, so no Welch interval and no power line; the permutation test is its rank among
    # the pooled seeds: 0.45 - (0.35 + 0.31) / 2 = +0.120, the largest of the three splits (-0.03 and -0.09)
    one_seed = run(tmp_path / "spa_s0", tmp_path / "format_s0", tmp_path / "format_s1", "--compare", "spa", "format")
    assert one_seed.returncode == 0, one_seed.stderr
    assert one_seed.stdout.splitlines()[-1] == (
        "spa − format at step 25, over seeds (1 and 2): +0.120; one seed in row spa: no interval over seeds "
        "(Welch's needs two a row); exact permutation test of the seeds: one-sided p = 0.333, two-sided p = 0.333")
    write_arm(tmp_path / "short", "spa_s0", {0: 0.0})
    none = run(tmp_path / "short", tmp_path / "format_s0", "--step", "25", "--compare", "spa", "format")
    assert none.returncode == 2 and none.stderr.strip() == "error: row spa has no seed validated at step 25"
    unknown = run(tmp_path, "--compare", "spa", "vanilla")
    assert unknown.returncode == 2 and unknown.stderr.strip() == "error: no row named vanilla (rows: format, spa)"


def test_the_power_line_needs_two_seeds_without_spread_and_none_finds_equal_means():
    sys.path.insert(0, str(SCRIPT.parent))
    import table2_rows

    assert table2_rows.power_line([0.3, 0.3], [0.2, 0.2]).endswith(
        "at 2 and 2 seeds a difference of 0.000 is found; the observed 0.100 needs 2 seeds a row")
    assert table2_rows.power_line([0.3, 0.4], [0.4, 0.3]).endswith("the observed 0.000 needs no number of seeds a row")


def test_compare_also_goes_over_sft_checkpoints_where_a_sweep_holds_several_seeds_of_a_row(tmp_path):
    """Seeds of one sweep share its SFT checkpoint: spa has two in lease 1's, format two in lease 2's. Over
    checkpoints, each one's seeds averaged: spa 0.42, 0.38, 0.36 against format 0.30, 0.33, 0.28, every spa
    checkpoint above every format one (one split of 20)."""
    seeds = {"lease1": {"spa_s0": 0.40, "spa_s1": 0.44, "format_s0": 0.30},
             "lease2": {"spa_s2": 0.38, "format_s1": 0.34, "format_s2": 0.32},
             "lease3": {"spa_s3": 0.36, "format_s3": 0.28}}
    folders = []
    for lease, arms in seeds.items():
        runs = tmp_path / lease / "table2_wm" / "ppo" / "_2_sokoban"
        for name, success in arms.items():
            write_arm(runs, name, {0: 0.0, 25: success})
        folders.append(runs)
    done = run(*folders, "--compare", "spa", "format")
    assert done.returncode == 0, done.stderr
    seed_line, checkpoint_line = done.stdout.splitlines()[-3:-1]
    assert seed_line.startswith("spa − format at step 25, over seeds (4 and 4): +0.085,")
    assert checkpoint_line.startswith("spa − format at step 25, over SFT checkpoints (3 and 3): +0.083, Welch 95% "
                                      "interval [+0.019, +0.148] (df 3.9)")  # t_{0.975, 3.86} = 2.817
    assert checkpoint_line.endswith("exact permutation test of the SFT checkpoints: one-sided p = 0.050, "
                                    "two-sided p = 0.100")
    one_sweep = run(folders[0], "--compare", "spa", "format")  # spa's two seeds, one checkpoint; format has one seed
    assert one_sweep.returncode == 0, one_sweep.stderr
    assert one_sweep.stdout.splitlines()[-2:] == [
        "spa − format at step 25, over seeds (2 and 1): +0.120; one seed in row format: no interval over seeds "
        "(Welch's needs two a row); exact permutation test of the seeds: one-sided p = 0.333, two-sided p = 0.333",
        "over SFT checkpoints: row spa's seeds all start from one checkpoint, no comparison"]
    spa_in_one = run(folders[0], folders[2] / "format_s3", "--compare", "spa", "format")
    assert spa_in_one.returncode == 0, spa_in_one.stderr
    assert spa_in_one.stdout.splitlines()[-2] == ("over SFT checkpoints: row spa's seeds all start from one "
                                                  "checkpoint, no comparison")
    separate = run(*(folders[i] / name for i, arms in enumerate(seeds.values()) for name in arms if "_s0" in name
                     or name in ("spa_s2", "format_s3")), "--compare", "spa", "format")
    assert "over SFT checkpoints" not in separate.stdout  # one seed a checkpoint: the seed line says it all


def test_a_seed_run_again_from_another_checkpoint_is_named_into_its_row(tmp_path):
    """Seed 1 of spa ran in lease 1 and again in lease 2 from lease 2's SFT checkpoint, both directories spa_s1:
    `spa_s1b=RUN` makes the second a seed of row spa, and of lease 2's checkpoint."""
    first, second = (tmp_path / lease / "wm" / "ppo" / "_2_sokoban" for lease in ("lease1", "lease2"))
    write_arm(first, "spa_s0", {0: 0.0, 25: 0.40})
    write_arm(first, "spa_s1", {0: 0.0, 25: 0.44})
    write_arm(second, "spa_s1", {0: 0.0, 25: 0.30})
    formats = [tmp_path / f"lease{seed + 3}" / "nowm" / "ppo" / "_2_sokoban" for seed in range(3)]
    for seed, success in enumerate((0.30, 0.31, 0.32)):
        write_arm(formats[seed], f"format_s{seed}", {0: 0.2, 25: success})
    clash = run(first, second, *formats)
    assert clash.returncode == 2 and "two arms are named spa_s1" in clash.stderr
    done = run(first, f"spa_s1b={second / 'spa_s1'}", *formats, "--compare", "spa", "format")
    assert done.returncode == 0, done.stderr
    # 0.380 over 3 x 512 episodes: Wilson [0.356, 0.405]
    assert "| spa | 3 | 0.000 [0.000, 0.002] | 0.380 [0.356, 0.405] | +0.380 | 0.400, 0.440, 0.300 |" in done.stdout
    seed_line, checkpoint_line = done.stdout.splitlines()[-3:-1]
    assert seed_line.startswith("spa − format at step 25, over seeds (3 and 3): +0.070,")
    # checkpoints: lease 1's two seeds averaged (0.42) and lease 2's one (0.30), against 0.30, 0.31, 0.32
    assert checkpoint_line.startswith("spa − format at step 25, over SFT checkpoints (2 and 3): +0.050,")


def test_onsets_compare_as_times_to_an_event_with_the_runs_without_one_censored(tmp_path):
    """At level 0.2: spa rises at steps 25 and 50, format at 50, and format_s1 has no onset by its last validation
    (75: censored there). Log-rank by hand: at step 25, 1 event in 4 at risk (2 spa): expected 0.5, variance
    0.25; at step 50, 2 events in 3 at risk (1 spa): expected 0.667, variance 2 * 1/3 * 2/3 * 1/2 = 0.222. Observed
    2, z = 0.833 / 0.687 = 1.213, two-sided p = 0.225. Kaplan–Meier: spa at 0.5 after step 25, format after 50."""
    write_arm(tmp_path, "spa_s0", {0: 0.1, 25: 0.3, 50: 0.3})
    write_arm(tmp_path, "spa_s1", {0: 0.1, 25: 0.1, 50: 0.3})
    write_arm(tmp_path, "format_s0", {0: 0.1, 25: 0.1, 50: 0.3})
    write_arm(tmp_path, "format_s1", {0: 0.1, 25: 0.1, 50: 0.1, 75: 0.1})
    done = run(tmp_path, "--step", "50", "--onset", "0.2", "--compare", "spa", "format")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == (
        "onset (success ≥ 0.200 to the last validation), runs without one censored at their last validation: "
        "Kaplan–Meier median spa 25 (2 of 2 runs with an onset), format 50 (1 of 2 runs with an onset); "
        "log-rank z = +1.21 (spa earlier if > 0), two-sided p = 0.225 (normal approximation)")


def test_a_run_the_stop_rule_ended_is_censored_at_its_stop_or_never_rises_with_count_stopped(tmp_path):
    """format_s2 collapsed at step 10. Without --count-stopped it is censored there, before any onset, and the test
    is the one above; with it, it stays at risk: at step 25, 1 event in 5 (expected 0.4, variance 0.24), at 50, 2 in
    4 with 1 spa (expected 0.5, variance 2 * 1/4 * 3/4 * 2/3 = 0.25): z = 1.1 / 0.7 = 1.571, p = 0.116, and
    format's Kaplan–Meier estimate stays at 2/3."""
    write_arm(tmp_path, "spa_s0", {0: 0.1, 25: 0.3, 50: 0.3})
    write_arm(tmp_path, "spa_s1", {0: 0.1, 25: 0.1, 50: 0.3})
    write_arm(tmp_path, "format_s0", {0: 0.1, 25: 0.1, 50: 0.3})
    write_arm(tmp_path, "format_s1", {0: 0.1, 25: 0.1, 50: 0.1, 75: 0.1})
    write_stopped_arm(tmp_path, "format_s2", stop_step=10, threshold=3)
    command = [tmp_path, "--step", "50", "--onset", "0.2", "--compare", "spa", "format"]
    plain = run(*command)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.splitlines()[-1].endswith(
        "format 50 (1 of 3 runs with an onset); log-rank z = +1.21 (spa earlier if > 0), two-sided p = 0.225 "
        "(normal approximation)")
    counted = run(*command, "--count-stopped")
    assert counted.returncode == 0, counted.stderr
    assert counted.stdout.splitlines()[-1] == (
        "onset (success ≥ 0.200 to the last validation), runs without one censored at their last validation, the "
        "runs the stop rule ended never rising: Kaplan–Meier median spa 25 (2 of 2 runs with an onset), format not "
        "reached (1 of 3 runs with an onset); log-rank z = +1.57 (spa earlier if > 0), two-sided p = 0.116 "
        "(normal approximation)")


def write_stopped_arm(directory: Path, name: str, stop_step: int, threshold: int):
    """A run the stop rule ended at `stop_step`: its last `threshold` steps scored every trajectory alike, its config
    asks to stop after `threshold` such steps, its validations at 0 and at the stop found no success."""
    write_arm(directory, name, {0: 0.01, stop_step: 0.0})
    records = [json.loads(line) for line in (directory / name / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record["rollout/uniform_score_streak"] = float(max(0, record["step"] - stop_step + threshold))
    (directory / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / name / "config.yaml").write_text(f"trainer:\n  stop_after_uniform_scores: {threshold}\n")


def test_count_stopped_counts_a_collapsed_run_at_the_step_and_leaves_a_cut_short_one_out(tmp_path):
    """spa_s1 collapsed (the stop rule ended it at step 10 with no success), spa_s2 was cut short at step 25 (a
    lease's end, no uniform scores): at step 50 the first counts with its 0.000 under --count-stopped, the second
    never."""
    write_arm(tmp_path, "spa_s0", {0: 0.01, 25: 0.2, 50: 0.3})
    write_stopped_arm(tmp_path, "spa_s1", stop_step=10, threshold=3)
    write_arm(tmp_path, "spa_s2", {0: 0.01, 25: 0.25})
    (tmp_path / "spa_s2" / "config.yaml").write_text("trainer:\n  stop_after_uniform_scores: 3\n")
    plain = run(tmp_path, "--step", "50")
    assert plain.returncode == 0, plain.stderr
    assert "| spa | 1 | 0.010 [0.004, 0.023] | 0.300 [0.262, 0.341] | +0.290 | 0.300 |" in plain.stdout
    assert plain.stdout.strip().endswith("not validated at step 50: spa_s1, spa_s2")
    counted = run(tmp_path, "--step", "50", "--count-stopped")
    assert counted.returncode == 0, counted.stderr
    lines = counted.stdout.splitlines()
    assert lines[0] == ("counted at step 50 with the validation of their stop (--count-stopped): "
                        "spa_s1 (0.000 at step 10)")
    # 0.150 over 2 x 512 episodes: Wilson [0.129, 0.173]
    assert "| spa | 2 | 0.010 [0.005, 0.018] | 0.150 [0.129, 0.173] | +0.140 | 0.300, 0.000 |" in counted.stdout
    assert counted.stdout.strip().endswith("not validated at step 50: spa_s2")


def test_wm_eval_evaluations_beside_the_runs_make_a_world_model_table(tmp_path):
    """smollm2_sweep.sh's WM_EVAL writes <sweep>/wm_eval/<arm>/eval.json beside <sweep>/ppo/<config>/<arm>."""
    runs = tmp_path / "table2_wm" / "ppo" / "_2_sokoban"
    write_arm(runs, "grpo_guard_s3", {0: 0.0, 25: 0.4})
    write_arm(runs, "grpo_guard_s4", {0: 0.0, 25: 0.3})  # stopped without an evaluation
    evaluation = tmp_path / "table2_wm" / "wm_eval" / "grpo_guard_s3" / "eval.json"
    evaluation.parent.mkdir(parents=True)
    evaluation.write_text(json.dumps({"metrics": {"SimpleSokoban": {
        "success": 0.25, "worldmodel/observation_exact": 0.9, "worldmodel/prediction_exact": 0.05}}}))
    for directories in ([runs], [runs / "grpo_guard_s3", runs / "grpo_guard_s4"]):
        done = run(*directories)
        assert done.returncode == 0, done.stderr
        assert done.stdout.endswith(
            "| arm (last checkpoint, the SFT's own prompts) | success | observation exact | prediction exact |\n"
            "|---|---|---|---|\n| grpo_guard_s3 | 0.250 | 0.900 | 0.050 |\n")
    assert "| arm (last checkpoint" not in run(runs / "grpo_guard_s4").stdout  # no table without an evaluation


def test_the_studys_runs_file_reproduces_its_step_275_comparison():
    """docs/smollm2.md's Table 2: the runs docs/results/smollm2_study300/grpo_guard_runs.txt lists (read as @FILE,
    its comments skipped), compared at step 275, give the numbers the docs report, without and with the runs that
    the stop rule ended (--count-stopped: lease 7's two world-model runs and lease 8's three Vanilla RL ones)."""
    repo = SCRIPT.parents[1]
    command = [sys.executable, str(SCRIPT), "@docs/results/smollm2_study300/grpo_guard_runs.txt", "--step", "275",
               "--compare", "grpo_guard", "format_grpo_guard"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[2].startswith("| grpo_guard | 5 | 0.006 [0.004, 0.010] | 0.369 [0.350, 0.388] | +0.363 | "
                               "0.456, 0.384, 0.369, 0.349, 0.287 |")
    assert lines[3].startswith("| format_grpo_guard | 6 | 0.194 [0.181, 0.209] | 0.339 [0.322, 0.356] | +0.144 |")
    # lease 12's nopred ablation, the one run of the own-prompt rows that reached step 275
    assert lines[4] == ("| nopred_grpo_guard | 1 | 0.089 [0.067, 0.117] | 0.479 [0.437, 0.523] | +0.391 | 0.479 | "
                        "0.998 → 0.530 | 0.000 → 0.000 |")
    assert lines[6] == ("not validated at step 275: grpo_guard_s4, grpo_guard_s5, grpo_guard_s6, grpo_guard_s4b, "
                        "grpo_guard_s5b, grpo_guard_s7, grpo_guard_s8, grpo_guard_s9, grpo_guard_s11, grpo_guard_s12, "
                        "format_grpo_guard_s4, format_grpo_guard_s5, format_grpo_guard_s5b, vanilla_grpo_guard_s3, "
                        "vanilla_grpo_guard_s4, vanilla_grpo_guard_s5, spa_grpo_guard_s1, spa_grpo_guard_s2, "
                        "spa_grpo_guard_s3, spa_grpo_guard_s4, spa_grpo_guard_s5")
    seeds, checkpoints = (line for line in lines if line.startswith("grpo_guard − format_grpo_guard at step 275"))
    assert seeds.startswith("grpo_guard − format_grpo_guard at step 275, over seeds (5 and 6): +0.030, Welch 95% "
                            "interval [-0.045, +0.105] (df 6.1); exact permutation test of the seeds: one-sided "
                            "p = 0.165")
    assert checkpoints.startswith("grpo_guard − format_grpo_guard at step 275, over SFT checkpoints (4 and 5): "
                                  "+0.027")
    assert ("power over seeds (80%, two-sided 5%, normal approximation): at 5 and 6 seeds a difference of 0.086 is "
            "found; the observed 0.030 needs 43 seeds a row") in lines
    # their world model after PPO, in the SFT's prompts
    assert lines[-2].startswith("| grpo_guard_s3 | 0.287 |") and lines[-1].startswith("| grpo_guard_s10 | 0.172 |")

    counted = subprocess.run([*command, "--count-stopped"], capture_output=True, text=True, cwd=repo)
    assert counted.returncode == 0, counted.stderr
    lines = counted.stdout.splitlines()
    assert lines[0] == ("counted at step 275 with the validation of their stop (--count-stopped): "
                        "grpo_guard_s8 (0.000 at step 58), grpo_guard_s9 (0.000 at step 24), "
                        "vanilla_grpo_guard_s3 (0.000 at step 20), vanilla_grpo_guard_s4 (0.000 at step 20), "
                        "vanilla_grpo_guard_s5 (0.000 at step 20)")
    assert lines[4].startswith("| grpo_guard | 7 | 0.005 [0.003, 0.008] | 0.264 [0.249, 0.278] | +0.258 | "
                               "0.456, 0.384, 0.369, 0.349, 0.000, 0.000, 0.287 |")
    assert lines[6].startswith("| vanilla_grpo_guard | 3 | 0.000 [0.000, 0.002] | 0.000 [0.000, 0.002] | +0.000 |")
    assert any(line.startswith("grpo_guard − format_grpo_guard at step 275, over seeds (7 and 6): -0.075, Welch 95% "
                               "interval [-0.248, +0.098]") for line in lines)

    # the onsets at the SFT-only model's success + 0.05, every run counted: the world-model row's earlier rise is
    # not beyond chance, and none of it is left with the collapses counted as never rising
    for extra, medians, test in (([], "grpo_guard 175 (7 of 15 runs with an onset), format_grpo_guard 200 (7 of 9 "
                                  "runs with an onset)", "log-rank z = +0.87 (grpo_guard earlier if > 0), two-sided "
                                  "p = 0.386"),
                                 (["--count-stopped"], "grpo_guard 200 (7 of 15 runs with an onset), "
                                  "format_grpo_guard 200 (7 of 9 runs with an onset)", "log-rank z = +0.00 "
                                  "(grpo_guard earlier if > 0), two-sided p = 0.997")):
        onsets = subprocess.run([*command, "--onset", "0.235", *extra], capture_output=True, text=True, cwd=repo)
        assert onsets.returncode == 0, onsets.stderr
        assert f"Kaplan–Meier median {medians}; {test}" in onsets.stdout.splitlines()[-1]


def test_the_studys_runs_file_reproduces_its_own_prompt_rows_step_200_comparison():
    """docs/smollm2.md's sixteenth lease: SPA with PPO in the world-model SFT's own prompts (five seeds from four SFT
    checkpoints, leases 9, 12, 15 and 16) against the format-only row at step 200, the last validation all five
    reached: its SFT-only start, its world model's accuracy before and after PPO, the comparison over seeds and over
    checkpoints, and its onset against the control's. At step 225 the row is lease 9's two seeds, lease 15's and
    lease 16's; at step 250 lease 15's seed alone, against the format-only row's seven runs there."""
    repo = SCRIPT.parents[1]
    command = [sys.executable, str(SCRIPT), "@docs/results/smollm2_study300/grpo_guard_runs.txt", "--step", "200",
               "--onset", "0.235", "--compare", "spa_grpo_guard", "format_grpo_guard"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[3].startswith("| format_grpo_guard | 9 | 0.196 [0.185, 0.208] | 0.238 [0.226, 0.251] | +0.042 |")
    assert lines[4] == ("| spa_grpo_guard | 5 | 0.173 [0.159, 0.188] | 0.369 [0.350, 0.388] | +0.196 | 0.413, 0.351, "
                        "0.331, 0.392, 0.358 | 0.998 → 0.774 | 0.259 → 0.011 |")
    assert ("spa_grpo_guard − format_grpo_guard at step 200, over seeds (5 and 9): +0.131, Welch 95% interval "
            "[+0.090, +0.172] (df 7.5); exact permutation test of the seeds: one-sided p = 0.000, two-sided "
            "p = 0.000") in lines
    assert ("spa_grpo_guard − format_grpo_guard at step 200, over SFT checkpoints (4 and 6): +0.128, Welch 95% "
            "interval [+0.086, +0.169] (df 6.6); exact permutation test of the SFT checkpoints: one-sided p = 0.005, "
            "two-sided p = 0.005") in lines
    assert lines[-1].startswith("onset (success ≥ 0.235 to the last validation), runs without one censored at their "
                                "last validation: Kaplan–Meier median spa_grpo_guard 50 (5 of 5 runs with an onset), "
                                "format_grpo_guard 200 (7 of 9 runs with an onset); log-rank z = +3.66")

    # docs/smollm2.md's Table 2 at equal PPO steps: every row at step 200, the runs the stop rule ended counted
    counted = subprocess.run([*command[:5], "--count-stopped"], capture_output=True, text=True, cwd=repo)
    assert counted.returncode == 0, counted.stderr
    rows = [line for line in counted.stdout.splitlines() if line.startswith("| ") and not line.startswith("| row")]
    assert [" | ".join(row.split(" | ")[:4]) for row in rows[:5]] == [
        "| grpo_guard | 10 | 0.006 [0.004, 0.008] | 0.233 [0.222, 0.245]",
        "| format_grpo_guard | 9 | 0.196 [0.185, 0.208] | 0.238 [0.226, 0.251]",
        "| vanilla_grpo_guard | 3 | 0.000 [0.000, 0.002] | 0.000 [0.000, 0.002]",
        "| spa_grpo_guard | 5 | 0.173 [0.159, 0.188] | 0.369 [0.350, 0.388]",
        "| nopred_grpo_guard | 1 | 0.089 [0.067, 0.117] | 0.371 [0.330, 0.414]"]

    at_225 = subprocess.run([*command[:4], "225", *command[5:]], capture_output=True, text=True, cwd=repo)
    assert at_225.returncode == 0, at_225.stderr
    assert ("spa_grpo_guard − format_grpo_guard at step 225, over seeds (4 and 9): +0.144, Welch 95% interval "
            "[+0.094, +0.194] (df 7.2); exact permutation test of the seeds: one-sided p = 0.001, two-sided "
            "p = 0.001") in at_225.stdout.splitlines()
    assert ("spa_grpo_guard − format_grpo_guard at step 225, over SFT checkpoints (3 and 6): +0.145, Welch 95% "
            "interval [+0.111, +0.179] (df 7.0); exact permutation test of the SFT checkpoints: one-sided p = 0.012, "
            "two-sided p = 0.012") in at_225.stdout.splitlines()

    at_250 = subprocess.run([*command[:4], "250", *command[5:]], capture_output=True, text=True, cwd=repo)
    assert at_250.returncode == 0, at_250.stderr
    lines = at_250.stdout.splitlines()
    assert lines[3].startswith("| format_grpo_guard | 7 | 0.195 [0.183, 0.209] | 0.307 [0.292, 0.322] | +0.111 | "
                               "0.280, 0.267, 0.341, 0.279, 0.383, 0.269, 0.327 |")
    assert lines[4].startswith("| spa_grpo_guard | 1 | 0.188 [0.156, 0.224] | 0.416 [0.374, 0.459] | +0.229 | 0.416 |")
    assert ("spa_grpo_guard − format_grpo_guard at step 250, over seeds (1 and 7): +0.110; one seed in row "
            "spa_grpo_guard: no interval over seeds (Welch's needs two a row); exact permutation test of the seeds: "
            "one-sided p = 0.125, two-sided p = 0.125") in lines


def test_the_studys_runs_file_reproduces_the_nopred_ablations_comparisons():
    """docs/smollm2.md's twelfth lease: the SFT without the prediction's loss, then the same own-prompt PPO (one seed),
    against the format-only control at step 275 and against SPA's own-prompt row at step 225: one seed gets the exact
    permutation test (its rank among the pooled seeds) and no interval over seeds."""
    repo = SCRIPT.parents[1]

    def compare(step, first, second):
        done = subprocess.run([sys.executable, str(SCRIPT), "@docs/results/smollm2_study300/grpo_guard_runs.txt",
                               "--step", step, "--onset", "0.235", "--compare", first, second],
                              capture_output=True, text=True, cwd=repo)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    lines = compare("275", "nopred_grpo_guard", "format_grpo_guard")
    assert ("nopred_grpo_guard − format_grpo_guard at step 275, over seeds (1 and 6): +0.141; one seed in row "
            "nopred_grpo_guard: no interval over seeds (Welch's needs two a row); exact permutation test of the "
            "seeds: one-sided p = 0.143, two-sided p = 0.143") in lines
    assert lines[-1].startswith("onset (success ≥ 0.235 to the last validation), runs without one censored at their "
                                "last validation: Kaplan–Meier median nopred_grpo_guard 100 (1 of 1 runs with an "
                                "onset), format_grpo_guard 200 (7 of 9 runs with an onset); log-rank z = +3.00")
    lines = compare("225", "spa_grpo_guard", "nopred_grpo_guard")
    assert ("spa_grpo_guard − nopred_grpo_guard at step 225, over seeds (4 and 1): +0.009; one seed in row "
            "nopred_grpo_guard: no interval over seeds (Welch's needs two a row); exact permutation test of the "
            "seeds: one-sided p = 0.600, two-sided p = 1.000") in lines

"""benchmarks/study_curves.py: the arms it reads, the panels it draws and the validation table it prints."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "study_curves.py"


def write_arm(directory: Path, name: str, success_at_25: float, steps: int, critic: bool) -> None:
    records = [{"step": 0, "val-env/SimpleSokoban/success": 0.035}]
    for step in range(1, steps + 1):
        record = {"step": step, "train/SimpleSokoban/success": 0.1, "train/diag/format_valid": 0.9,
                  "diag/entropy/answer": 0.7, "diag/kl_ref": 0.01 * step, "timing_s/step": 9.0}
        if critic:
            record["critic/vf_explained_var"] = 0.05
        if step == 25:
            record["val-env/SimpleSokoban/success"] = success_at_25
        records.append(record)
    (directory / name).mkdir()
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (directory / name / "metrics.jsonl").write_text(lines + '{"step": 99, "cut sh')  # a run stopped mid-line


def test_arms_side_by_side_with_wilson_intervals(tmp_path):
    write_arm(tmp_path, "gae", 0.25, 30, critic=True)
    write_arm(tmp_path, "grpo", 0.5, 26, critic=False)
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--out", str(tmp_path / "c.png"),
                             "--val-episodes", "512"], capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert lines[0] == "| arm | step 0 | step 25 | last step |"
    # 0.035 of 512: Wilson [0.022, 0.055]; 0.25: [0.214, 0.289]; 0.5: [0.457, 0.543]
    assert "| gae | 0.035 [0.022, 0.055] | 0.250 [0.214, 0.289] | 30 |" in lines
    assert "| grpo | 0.035 [0.022, 0.055] | 0.500 [0.457, 0.543] | 26 |" in lines
    assert (tmp_path / "c.png").stat().st_size > 0


def test_panels_are_those_some_arm_logs(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import study_curves

    write_arm(tmp_path, "grpo", 0.5, 26, critic=False)
    titles = [title for _, title in study_curves.panels(study_curves.read_arms(tmp_path))]
    assert titles == ["validation success", "training success", "well-formed training turns",
                      "answer-span entropy", "KL to the reference model", "seconds a step"]  # no critic


def test_memory_panels_where_an_arm_logs_them(tmp_path):
    """Runs on a GPU log each step's peak memory and what the process held (memory_gb/*): two panels after the
    step's seconds."""
    sys.path.insert(0, str(SCRIPT.parent))
    import study_curves

    write_arm(tmp_path, "gpu_arm", 0.3, 26, critic=True)
    path = tmp_path / "gpu_arm" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    for record in records[1:]:
        record.update({"memory_gb/step": 38.5, "memory_gb/reserved": 41.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    titles = [title for _, title in study_curves.panels(study_curves.read_arms(tmp_path))]
    assert titles[-3:] == ["seconds a step", "GPU memory: the step's peak, GiB", "GPU memory held, GiB"]


def test_a_panel_of_the_tokens_a_trajectory_sampled_where_an_arm_logs_them(tmp_path):
    """train/response_length (a training trajectory's sampled tokens, mean): the panel before the step's seconds, where
    a run that writes long (the study's fifth lease) shows at once."""
    sys.path.insert(0, str(SCRIPT.parent))
    import study_curves

    write_arm(tmp_path, "long", 0.3, 26, critic=False)
    path = tmp_path / "long" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    for record in records[1:]:
        record["train/response_length"] = 120.0
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    titles = [title for _, title in study_curves.panels(study_curves.read_arms(tmp_path))]
    assert titles[-2:] == ["sampled tokens a trajectory (training)", "seconds a step"]


def test_world_model_accuracy_panels_where_an_arm_logs_them(tmp_path):
    """An add_worldmodel arm logs its validation's world-model accuracy; the panels follow the fixed ones, once for
    all arms, and the arms without them (base prompts) are drawn beside it."""
    sys.path.insert(0, str(SCRIPT.parent))
    import study_curves

    write_arm(tmp_path, "format_s0", 0.2, 26, critic=True)
    write_arm(tmp_path, "spa_s0", 0.3, 26, critic=True)
    path = tmp_path / "spa_s0" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first.update({"val-env/SimpleSokoban/worldmodel/observation_exact": 0.99,
                  "val-env/SimpleSokoban/worldmodel/prediction_exact": 0.28})
    path.write_text("\n".join([json.dumps(first), *lines[1:]]))
    drawn = study_curves.panels(study_curves.read_arms(tmp_path))
    assert drawn[-2:] == [("val-env/SimpleSokoban/worldmodel/observation_exact", "validation: observation exact"),
                          ("val-env/SimpleSokoban/worldmodel/prediction_exact", "validation: prediction exact")]
    assert len(drawn) == 9
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--out", str(tmp_path / "c.png")],
                            capture_output=True, text=True, check=True)
    assert result.stdout.splitlines()[0] == "| arm | step 0 | step 25 | last step |"  # the table: success alone


def test_no_arms_is_a_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip() == f"error: no <arm>/metrics.jsonl under {tmp_path}"


def test_arms_of_several_sweeps_side_by_side(tmp_path):
    """Issue 43's Table 2 lease: one sweep per start (docs/results/smollm2_table2), one table of all their arms."""
    spa, vanilla = tmp_path / "wm", tmp_path / "base"
    for directory, name, success in ((spa, "spa_s0", 0.25), (vanilla, "vanilla_s0", 0.5)):
        directory.mkdir()
        write_arm(directory, name, success, 25, critic=True)
    command = [sys.executable, str(SCRIPT), str(spa), str(vanilla), "--out", str(tmp_path / "c.png")]
    lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[2:] == ["| spa_s0 | 0.035 [0.022, 0.055] | 0.250 [0.214, 0.289] | 25 |",
                         "| vanilla_s0 | 0.035 [0.022, 0.055] | 0.500 [0.457, 0.543] | 25 |"]
    result = subprocess.run([*command[:3], str(spa)], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip() == f"error: two arms are named spa_s0, one in {spa}: " \
        "give each its own name (NAME=RUN)"


def test_a_run_directory_is_one_arm(tmp_path):
    """One arm of a folder beside another folder's arm of the same row: a rerun replaces an earlier lease's seed."""
    earlier, later = tmp_path / "lease2", tmp_path / "lease3"
    earlier.mkdir(), later.mkdir()
    write_arm(earlier, "grpo_s0", 0.25, 25, critic=False)
    write_arm(earlier, "grpo_s1", 0.125, 25, critic=False)  # stopped short; lease 3 ran it again
    write_arm(later, "grpo_s1", 0.5, 25, critic=False)
    command = [sys.executable, str(SCRIPT), str(earlier / "grpo_s0"), str(later), "--out", str(tmp_path / "c.png")]
    lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[2:] == ["| grpo_s0 | 0.035 [0.022, 0.055] | 0.250 [0.214, 0.289] | 25 |",
                         "| grpo_s1 | 0.035 [0.022, 0.055] | 0.500 [0.457, 0.543] | 25 |"]


def test_name_equals_run_names_a_seed_run_again_from_another_sft_checkpoint(tmp_path):
    """Two leases ran seed 1 from two SFT checkpoints, both directories named grpo_s1: NAME=RUN keeps both, and the
    letter after the seed keeps the second in row grpo."""
    earlier, later = tmp_path / "lease5", tmp_path / "lease6"
    earlier.mkdir(), later.mkdir()
    write_arm(earlier, "grpo_s1", 0.25, 25, critic=False)
    write_arm(later, "grpo_s1", 0.5, 25, critic=False)
    command = [sys.executable, str(SCRIPT), str(earlier), f"grpo_s1b={later / 'grpo_s1'}", "--out",
               str(tmp_path / "c.png")]
    lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[2:] == ["| grpo_s1 | 0.035 [0.022, 0.055] | 0.250 [0.214, 0.289] | 25 |",
                         "| grpo_s1b | 0.035 [0.022, 0.055] | 0.500 [0.457, 0.543] | 25 |"]
    sys.path.insert(0, str(SCRIPT.parent))
    import study_curves

    assert study_curves.rows_of({"grpo_s1": [], "grpo_s1b": [], "format_s0": []}) == {
        "grpo": ["grpo_s1", "grpo_s1b"], "format": ["format_s0"]}
    missing = subprocess.run([*command[:3], f"grpo_s1b={later}"], capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"error: grpo_s1b={later}: {later} holds no metrics.jsonl"


def test_a_gzip_compressed_metrics_file_reads_as_the_plain_one(tmp_path):
    """docs/results keeps the runs' metrics.jsonl gzip-compressed: the same arms, the same table."""
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    write_arm(plain, "gae", 0.25, 30, critic=True)
    (packed / "gae").mkdir()
    (packed / "gae" / "metrics.jsonl.gz").write_bytes(gzip.compress((plain / "gae" / "metrics.jsonl").read_bytes()))
    tables = [subprocess.run([sys.executable, str(SCRIPT), str(folder), "--out", str(tmp_path / "c.png")],
                             capture_output=True, text=True, check=True).stdout for folder in (plain, packed)]
    assert tables[0] == tables[1] and "| gae | 0.035 [0.022, 0.055] | 0.250 [0.214, 0.289] | 30 |" in tables[1]


def test_by_row_draws_each_rows_mean_over_the_steps_all_its_seeds_reached(tmp_path):
    """--by-row: the arms `<row>_s<seed>` of a row share a colour, and the row's mean validation success at a step
    is over the seeds that validated there, with their count; a step with fewer than two is left out."""
    sys.path.insert(0, str(SCRIPT.parent))
    import study_curves

    write_arm(tmp_path, "spa_s0", 0.30, 30, critic=False)
    write_arm(tmp_path, "spa_s1", 0.40, 30, critic=False)
    write_arm(tmp_path, "format_s0", 0.20, 30, critic=False)
    write_arm(tmp_path, "format_s1", 0.22, 20, critic=False)  # stopped before its step-25 validation
    write_arm(tmp_path, "format_s2", 0.30, 30, critic=False)
    write_arm(tmp_path, "vanilla", 0.0, 26, critic=False)
    arms = study_curves.read_arms(tmp_path)
    rows = study_curves.rows_of(arms)
    assert rows == {"format": ["format_s0", "format_s1", "format_s2"], "spa": ["spa_s0", "spa_s1"],
                    "vanilla": ["vanilla"]}
    key = "val-env/SimpleSokoban/success"
    assert study_curves.row_means(arms, rows["spa"], key) == {0: (pytest.approx(0.035), 2), 25: (pytest.approx(0.35), 2)}
    assert study_curves.row_means(arms, rows["format"], key) == {0: (pytest.approx(0.035), 3), 25: (pytest.approx(0.25), 2)}
    assert study_curves.row_means(arms, rows["vanilla"], key) == {0: (0.035, 1), 25: (0.0, 1)}
    # two arms of which only one validated at step 25: the mean of one seed is not drawn there
    assert study_curves.row_means(arms, ["spa_s0", "format_s1"], key) == {0: (pytest.approx(0.035), 2)}
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--out", str(tmp_path / "rows.png"),
                             "--by-row"], capture_output=True, text=True, check=True)
    assert "| spa_s1 | 0.035 [0.022, 0.055] | 0.400 [0.358, 0.443] | 30 |" in result.stdout.splitlines()
    assert (tmp_path / "rows.png").stat().st_size > 0

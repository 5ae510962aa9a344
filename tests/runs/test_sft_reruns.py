"""SFT reruns: resume only a run of the same settings, data and model; a fresh run replaces the old one's outputs
consistently; incomplete datasets, null rows and cut-short metrics lines are handled."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sft"))
from sft_fixtures import synthetic_rows, write_rows  # noqa: E402

from sft import in_process  # noqa: E402
from sft.in_process import run  # noqa: E402
from sft.spa_sft_dataset import read_rows  # noqa: E402
from sft.spa_sft_trainer import SftTrainer  # noqa: E402
from SPA_agent.runs.dir_lock import LOCK_FILE, DirectoryLockedError  # noqa: E402
from SPA_agent.runs.run_identity import IDENTITY_FILE, RunMismatchError  # noqa: E402


def compose(data_dir: Path, out_dir: Path, *extra: str):
    overrides = [f"data.train_files={data_dir}/wm_train.parquet", f"data.val_files={data_dir}/wm_val.parquet",
                 "model.partial_pretrain=tiny", f"trainer.default_local_dir={out_dir}", "data.max_length=96",
                 "data.train_batch_size=4", "data.max_tokens_per_micro_batch=192", "optim.lr=1e-3",
                 "trainer.total_training_steps=1", "trainer.device=cpu", *extra]
    return in_process.compose(overrides)


def make_dataset(root: Path, seed: int = 0, card: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_rows(root / "wm_train.parquet", *synthetic_rows(8, seed=seed))
    write_rows(root / "wm_val.parquet", *synthetic_rows(4, seed=seed + 1))
    if card:
        (root / "data_card.json").write_text("{}")
    return root


def steps(out_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def outputs(out_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out_dir)): p.read_bytes() for p in sorted(out_dir.rglob("*")) if p.is_file()}


def test_changed_lr_is_refused_and_a_fresh_run_is_consistent(tmp_path):
    data, out = make_dataset(tmp_path / "data"), tmp_path / "sft"
    run(compose(data, out))
    first = outputs(out)
    with pytest.raises(RunMismatchError, match=r"optim.lr \(0.001 -> 0.01\).*trainer.resume=disable"):
        run(compose(data, out, "optim.lr=1e-2"))
    assert outputs(out) == first  # nothing was written
    run(compose(data, out, "optim.lr=1e-2", "trainer.resume=disable"))
    assert steps(out) == [1]
    assert "lr: 0.01" in (out / "sft_config.yaml").read_text()
    assert json.loads((out / IDENTITY_FILE).read_text())["config"]["optim.lr"] == 0.01
    assert (out / "global_step_1" / "model.safetensors").read_bytes() != first["global_step_1/model.safetensors"]
    assert load_file(out / "global_step_1" / "model.safetensors")  # a complete checkpoint


def test_moved_data_resumes_and_changed_data_or_model_is_refused(tmp_path):
    data, out = make_dataset(tmp_path / "data"), tmp_path / "sft"
    two_steps = ("trainer.total_training_steps=2", "trainer.save_freq=1")
    run(compose(data, out, *two_steps), stop_at_step=1)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "train/lo')  # killed while appending
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    run(compose(moved, out, *two_steps))  # same content elsewhere: the run continues
    assert steps(out) == [1, 2]
    other = make_dataset(tmp_path / "other", seed=5)
    with pytest.raises(RunMismatchError, match=r"input train data \(checksum differs\)"):
        run(compose(other, out, *two_steps))
    model = tmp_path / "model"
    shutil.copytree(_tiny_dir(), model)
    (model / "generation_config.json").write_text("{}")
    with pytest.raises(RunMismatchError, match=r"input model \(checksum differs\)"):
        run(compose(data, out, *two_steps, f"model.partial_pretrain={model}"))


def _tiny_dir() -> Path:
    from SPA_agent.tiny import tiny_model_dir

    return tiny_model_dir()


def test_incomplete_dataset_is_refused_unless_allowed(tmp_path):
    data = make_dataset(tmp_path / "data", card=False)
    with pytest.raises(ValueError, match="no data_card.json"):
        SftTrainer(compose(data, tmp_path / "sft")).preflight()
    SftTrainer(compose(data, tmp_path / "sft", "data.require_data_card=false")).preflight()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="cannot write to"):
        SftTrainer(compose(data, tmp_path / "a_file" / "sft", "data.require_data_card=false")).preflight()
    (data / "data_card.json").write_text("{}")
    (data / ".partial").mkdir()
    with pytest.raises(ValueError, match="unfinished data generation"):
        SftTrainer(compose(data, tmp_path / "sft")).preflight()


def test_data_of_another_config_is_refused(tmp_path):
    data = make_dataset(tmp_path / "data")
    (data / "data_card.json").write_text(json.dumps({"config_name": "_3_frozen_lake"}))
    message = (f"{data} holds _3_frozen_lake data (data_card.json) but this run is for _2_sokoban: pass the "
               "_2_sokoban data, or data.config_name=null to train on it anyway")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SftTrainer(compose(data, tmp_path / "sft", "data.config_name=_2_sokoban")).preflight()
    SftTrainer(compose(data, tmp_path / "sft", "data.config_name=_3_frozen_lake")).preflight()
    SftTrainer(compose(data, tmp_path / "sft")).preflight()  # null: no check
    # filtered data (sft/filter_sft_by_tag.py) carries the card of its source
    (data / "data_card.json").write_text(json.dumps({"source_card": {"config_name": "_3_frozen_lake"}}))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SftTrainer(compose(data, tmp_path / "sft", "data.config_name=_2_sokoban")).preflight()
    # the stage-2 script names its <env_type> as the config: one line, exit 2, nothing trained
    script = Path(__file__).resolve().parents[2] / "sft" / "finetune_ft.sh"
    result = subprocess.run(["bash", str(script), "_2_sokoban", "1", str(tmp_path / "sft"), str(data), "tiny",
                             "data.train_batch_size=4"],
                            capture_output=True, text=True, check=False, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable})
    assert result.returncode == 2 and result.stderr == f"error: {message}\n"
    assert not (tmp_path / "sft" / "train.log").exists()


def test_directory_of_an_older_version_is_refused_when_resuming(tmp_path):
    data, out = make_dataset(tmp_path / "data"), tmp_path / "sft"
    (out / "global_step_3").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RunMismatchError, match="holds outputs but no run_identity.json"):
        SftTrainer(compose(data, out)).preflight()
    run(compose(data, out, "trainer.resume=disable"))
    assert not (out / "global_step_3").exists() and (out / "notes.txt").read_text() == "mine"


def test_directory_in_use_by_another_run_is_refused(tmp_path):
    data, out = make_dataset(tmp_path / "data"), tmp_path / "sft"
    out.mkdir()
    (out / LOCK_FILE).write_text(f'{{"pid": {os.getppid()}, "host": "{socket.gethostname()}", "started": 0}}')
    with pytest.raises(DirectoryLockedError, match=f"in use by pid {os.getppid()}"):
        SftTrainer(compose(data, out)).preflight()


def test_null_response_or_message_is_one_line_naming_the_row(tmp_path):
    prompts, responses = synthetic_rows(3)
    responses[1] = None
    write_rows(tmp_path / "a.parquet", prompts, responses)
    with pytest.raises(ValueError, match=r"a.parquet row 1 has a null 'response'"):
        read_rows(str(tmp_path / "a.parquet"))
    prompts, responses = synthetic_rows(3)
    prompts[2][1]["content"] = None
    write_rows(tmp_path / "b.parquet", prompts, responses)
    with pytest.raises(ValueError, match=r"b.parquet row 2 has a null"):
        read_rows(str(tmp_path / "b.parquet"))

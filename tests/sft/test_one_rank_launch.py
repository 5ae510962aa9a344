"""sft/finetune_ft.sh with one rank: one process, no torchrun (trainer.log_file). It trains what torchrun's one rank
trained, holds the output directory's lock, writes train.log, and ends in one line when killed."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sft_fixtures import synthetic_rows, write_rows

from sft import spa_sft_trainer
from sft.config_checks import check_sft_config
from sft.in_process import compose
from SPA_agent.entry import EXIT_USAGE
from SPA_agent.runs.dir_lock import LOCK_FILE

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "sft" / "finetune_ft.sh"
#: two steps of 4 rows on the tiny model, a learning rate that moves the weights
SMALL = ("data.max_length=96", "data.train_batch_size=4", "data.max_tokens_per_micro_batch=192", "optim.lr=1e-3",
         "trainer.total_training_steps=2", "trainer.device=cpu")
#: the metrics that measure time, not what was trained
TIMINGS = {"train/step_s", "train/tokens_per_s", "val/seconds"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}


def sft_data(root: Path, train_rows: int = 8) -> Path:
    """A complete (carded) SFT dataset of hand-written rows."""
    root.mkdir(parents=True, exist_ok=True)
    write_rows(root / "wm_train.parquet", *synthetic_rows(train_rows, seed=0))
    write_rows(root / "wm_val.parquet", *synthetic_rows(4, seed=1))
    (root / "data_card.json").write_text("{}")
    return root


def finetune(out: Path, data: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "_2_sokoban", "1", str(out), str(data), "tiny", *SMALL, *extra],
                          capture_output=True, text=True, check=False, timeout=300, env={**ENV, **(env or {})})


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_one_rank_without_torchrun_trains_what_torchrun_trains(tmp_path):
    data, one, torchrun = sft_data(tmp_path / "data"), tmp_path / "one", tmp_path / "torchrun"
    result = finetune(one, data)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # what finetune_ft.sh ran for one rank before: its stage's arguments under sft.launch (torchrun)
    printed = finetune(torchrun, data, env={"SPA_PRINT_STAGE": "1"})
    stage_args = printed.stdout.splitlines()
    assert stage_args[-1] == "trainer.preflight_nproc=1"
    launched = subprocess.run([sys.executable, "-m", "sft.launch", "--standalone", "--nnodes=1", "--nproc_per_node=1",
                               *stage_args[:-1]], capture_output=True, text=True, check=False, timeout=300, env=ENV,
                              cwd=REPO)
    assert launched.returncode == 0, launched.stderr[-3000:]
    for a, b in zip(records(torchrun), records(one), strict=True):
        assert a.keys() == b.keys()
        for key in a.keys() - TIMINGS:  # losses, gradient norm, learning rate, token counts
            assert b[key] == pytest.approx(a[key], rel=0, abs=1e-6), key
    weights = {name: load_file(out / "global_step_2" / "model.safetensors") for name, out in
               (("torchrun", torchrun), ("one", one))}
    assert weights["one"].keys() == weights["torchrun"].keys()
    for name, tensor in weights["torchrun"].items():
        torch.testing.assert_close(weights["one"][name], tensor, rtol=0, atol=1e-6)
    log = (one / "train.log").read_text()
    assert log.startswith("sft data train: 8 rows") and "step 2/2: loss " in log and "saved global_step_2" in log
    assert log in result.stdout and not (one / LOCK_FILE).exists()
    # RESUME=1 continues the run and appends to its log
    resumed = finetune(one, data, env={"RESUME": "1"})
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert (one / "train.log").read_text().startswith(log)
    assert f"resumed from {one / 'global_step_2'} (step 2)" in (one / "train.log").read_text()[len(log):]


@pytest.mark.slow
def test_a_killed_one_rank_run_is_one_line_and_the_signal_status(tmp_path):
    """The kernel's out-of-memory killer sends SIGKILL: as sft.launch says of a rank, one line, in train.log too."""
    data, out = sft_data(tmp_path / "data", train_rows=64), tmp_path / "sft"
    long_run = [setting for setting in SMALL if not setting.startswith("trainer.total_training_steps=")]
    process = subprocess.Popen(["bash", str(SCRIPT), "_2_sokoban", "1", str(out), str(data), "tiny", *long_run],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    while not (out / "train.log").exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    assert len(children) == 1  # the trainer, the script's only child while it trains
    os.kill(int(children[0]), signal.SIGKILL)
    _, err = process.communicate(timeout=120)
    line = ("error: SFT was killed by signal 9 (the kernel's out-of-memory killer? lower "
            "data.max_tokens_per_micro_batch)")
    assert process.returncode == 128 + signal.SIGKILL and err == line + "\n"
    assert (out / "train.log").read_text().endswith(line + "\n")


def test_one_rank_refuses_a_directory_locked_after_its_checks(monkeypatch, capsys, tmp_path):
    """Another run took the lock after this one's checks passed (issue 44: two runs started 1 s apart): one line at
    the lock, and that run's train.log left alone."""
    data, out = sft_data(tmp_path / "data"), tmp_path / "sft"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "started": 0}))
    (out / "train.log").write_text("the other run's log\n")
    monkeypatch.setattr(spa_sft_trainer, "check_unlocked", lambda directory: None)  # the checks ran before its lock
    overrides = [f"data.train_files={data}/wm_train.parquet", "model.partial_pretrain=tiny",
                 f"trainer.default_local_dir={out}", f"trainer.log_file={out / 'train.log'}", *SMALL]
    monkeypatch.setattr(sys, "argv", ["sft.spa_sft_trainer", *overrides])
    with pytest.raises(SystemExit) as exit_info:
        spa_sft_trainer.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == EXIT_USAGE and err.startswith(f"error: {out} is in use by pid {os.getppid()}")
    assert err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, "train.log"]
    assert (out / "train.log").read_text() == "the other run's log\n"


@pytest.mark.parametrize("extra, ranks, message", [
    (["trainer.preflight_nproc=1"], 1, "got trainer.preflight_nproc=1 (only checks)"),
    ([], 2, "got 2 ranks"),
])
def test_a_log_file_is_for_one_process_without_torchrun(tmp_path, extra, ranks, message):
    cfg = compose(["data.train_files=x.parquet", f"trainer.log_file={tmp_path / 'train.log'}", *extra])
    expected = f"trainer.log_file checks and then trains in one process, without torchrun; {message}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        check_sft_config(cfg, ranks)

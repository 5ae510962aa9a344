"""End-to-end SFT runs on the tiny model: learning, checkpoints, resume, 2-process equivalence, entry errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sft_fixtures import synthetic_rows, write_rows

from sft.in_process import run
from sft.spa_sft_trainer import SftTrainer, resolve_model_path

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "sft" / "config"


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="sft_trainer", overrides=overrides)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sftdata")
    write_rows(root / "wm_train.parquet", *synthetic_rows(16, seed=0))
    write_rows(root / "wm_val.parquet", *synthetic_rows(4, seed=1))
    (root / "data_card.json").write_text("{}")  # a complete dataset
    return root


def overrides(data_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    """16 rows, batch 4: 4 steps per epoch; 6 steps in all, checkpoints at 2, 4 (epoch end) and 6."""
    return [f"data.train_files={data_dir}/wm_train.parquet", f"data.val_files={data_dir}/wm_val.parquet",
            "model.partial_pretrain=tiny", f"trainer.default_local_dir={out_dir}", "data.max_length=96",
            "data.train_batch_size=4", "data.max_tokens_per_micro_batch=192", "optim.lr=3e-3",
            "trainer.total_epochs=2", "trainer.total_training_steps=6", "trainer.save_freq=2",
            "trainer.max_ckpt_to_keep=1", "trainer.device=cpu", *extra]


def records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    run(compose(overrides(data_dir, out)))
    return out


@pytest.mark.slow
def test_loss_decreases_and_metrics_are_logged(full_run):
    rows = records(full_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    losses = [r["train/loss"] for r in rows]
    assert losses[-1] < losses[0] - 0.5
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/useful_token_fraction"} <= set(rows[0])
    assert rows[0]["train/useful_token_fraction"] == 1.0  # packed: no padding
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert len(val) == 2 and val[1] < val[0]


@pytest.mark.slow
def test_checkpoints_load_with_from_pretrained_and_retention_prunes(full_run, data_dir, tiny_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft.packing import collate_packed, token_loss_sum
    from sft.spa_sft_dataset import SpaSftDataset

    assert sorted(p.name for p in full_run.glob("global_step_*")) == ["global_step_4", "global_step_6"]
    assert not (full_run / "global_step_4" / "train_state").exists()  # old epoch end: HF weights only
    assert (full_run / "global_step_6" / "train_state" / "optimizer.pt").is_file()
    tuned = AutoModelForCausalLM.from_pretrained(full_run / "global_step_6")
    tokenizer = AutoTokenizer.from_pretrained(full_run / "global_step_6")
    assert tokenizer.get_vocab() == tiny_tokenizer.get_vocab()
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    val = SpaSftDataset(str(data_dir / "wm_val.parquet"), tokenizer, max_length=96)
    batch = collate_packed(val.samples, pad_id=0)
    with torch.no_grad():
        assert token_loss_sum(tuned, batch) < token_loss_sum(base, batch)


def test_truncation_is_logged_and_written_next_to_the_metrics(data_dir, tmp_path, capsys):
    # every synthetic row is 82 tiny-tokenizer tokens: max_length 80 cuts 2 prompt tokens from each
    trainer = SftTrainer(compose(overrides(data_dir, tmp_path, "data.max_length=80")))
    trainer.preflight()
    trainer.report_truncation()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"sft data {split}: {rows} rows, longest 82 tokens (data.max_length=80): {rows} truncated "
                     "(left), tokens cut max 2, mean 2.0, trained tokens cut 0" for split, rows in (("train", 16),
                                                                                                   ("val", 4))]
    written = json.loads((tmp_path / "truncation.json").read_text())
    assert written["train"] == {"rows": 16, "longest_row_tokens": 82, "max_length": 80, "truncation": "left",
                                "rows_truncated": 16, "tokens_cut_max": 2, "tokens_cut_mean": 2.0,
                                "trained_tokens_cut": 0}


@pytest.mark.slow
def test_resume_after_interruption_equals_uninterrupted_run(full_run, data_dir, tmp_path):
    run(compose(overrides(data_dir, tmp_path)), stop_at_step=3)  # killed after step 3: step 3 is lost
    assert max(r["step"] for r in records(tmp_path)) == 3
    run(compose(overrides(data_dir, tmp_path)))  # resume=auto picks global_step_2
    expected, got = records(full_run), records(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(expected, got):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
    weights = [load_file(d / "global_step_6" / "model.safetensors") for d in (full_run, tmp_path)]
    for key, value in weights[0].items():
        torch.testing.assert_close(weights[1][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_one_rank_plain_module_equals_one_rank_fsdp(full_run, data_dir, tmp_path):
    """One rank trains a plain module (trainer.fsdp=auto) with FSDP2's losses and weights: in float32 on CPU the
    two differ by summation order at most."""
    run(compose(overrides(data_dir, tmp_path, "trainer.fsdp=true")))
    for a, b in zip(records(full_run), records(tmp_path), strict=True):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
    weights = [load_file(d / "global_step_6" / "model.safetensors") for d in (full_run, tmp_path)]
    assert weights[0].keys() == weights[1].keys()
    for key, value in weights[0].items():
        torch.testing.assert_close(weights[1][key], value, rtol=1e-5, atol=1e-6)


def test_fsdp_auto_shards_only_with_several_ranks(data_dir, tmp_path):
    from torch.distributed.fsdp import FSDPModule

    for value, sharded in (("auto", False), ("true", True)):
        trainer = SftTrainer(compose(overrides(data_dir, tmp_path / value, f"trainer.fsdp={value}")))
        try:
            trainer.setup()
            assert isinstance(trainer.model, FSDPModule) == sharded, value
        finally:
            trainer.cleanup()


@pytest.mark.parametrize("value, ranks, message", [
    ("sometimes", 1, "trainer.fsdp must be auto, true or false, got 'sometimes'"),
    ("false", 2, "trainer.fsdp=false trains one rank only, got 2 ranks (use auto or true)"),
])
def test_fsdp_setting_is_checked(data_dir, tmp_path, value, ranks, message):
    from sft.config_checks import check_sft_config

    with pytest.raises(ValueError, match=re.escape(message)):
        check_sft_config(compose(overrides(data_dir, tmp_path, f"trainer.fsdp={value}")), ranks)


@pytest.mark.slow
def test_two_process_torchrun_matches_one_process(full_run, data_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    logs = tmp_path / "ranks"  # each rank's own output, which the launcher's traceback pushes out of its stderr
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--log-dir={logs}", "--redirects=3", "-m", "sft.spa_sft_trainer", *overrides(data_dir, tmp_path)]
    result = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    ranks = "".join(f"\n--- {log.relative_to(logs)}:\n{log.read_text()[-1500:]}" for log in sorted(logs.rglob("*.log")))
    assert result.returncode == 0, result.stderr[-1500:] + ranks
    for a, b in zip(records(full_run), records(tmp_path), strict=True):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-3)


@pytest.mark.slow
def test_two_ranks_with_an_empty_padded_micro_batch_match_one_rank(data_dir, tmp_path):
    """A 4-row batch in one bin leaves rank 1 an empty micro-batch each step (and in validation); with packed rows
    padded to a multiple (flex attention's 512 on GPU) that rank failed in torch.cat([]) (on 2 H200s). Its filler
    row must run the forward and add nothing: losses and gradient norms are those of one rank."""
    extra = ("data.max_tokens_per_micro_batch=4096", "data.pad_packed_to_multiple=64", "trainer.total_training_steps=2")
    one = tmp_path / "one"
    cfg = compose(overrides(data_dir, one, *extra))
    trainer = SftTrainer(cfg, rank=0, world_size=2)
    trainer.model_path = resolve_model_path("tiny")
    trainer._build_data()
    plan = trainer._plan(trainer.epoch_order(0)[:4], trainer.train_data)
    assert [len(m) for rank in plan for m in rank] == [4, 0]  # rank 1: one empty micro-batch
    run(cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "sft.spa_sft_trainer", *overrides(data_dir, tmp_path / "two", *extra)]
    result = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (first_one, last_one), (first_two, last_two) = records(one), records(tmp_path / "two")
    for a, b in ((first_one, first_two), (last_one, last_two)):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-3)
    assert last_two["val/loss"] == pytest.approx(last_one["val/loss"], rel=1e-4)


@pytest.mark.parametrize("extra, message", [
    (["data.train_batch_size=3", "data.packing=false", "data.micro_batch_size_per_gpu=2"],
     "data.train_batch_size=3 is not divisible by ranks × data.micro_batch_size_per_gpu = 2"),
    (["data.train_files=/nonexistent/wm_train.parquet"], "does not exist"),
])
def test_entry_point_user_errors_exit_2_with_one_line(data_dir, tmp_path, extra, message, call_entry):
    """In this process (the torchrun tests above and the run_spa.sh test start the entry point as processes)."""
    from sft import spa_sft_trainer

    code, err = call_entry(spa_sft_trainer, [*overrides(data_dir, tmp_path), *extra])
    assert code == 2 and message in err and err.startswith("error: ") and err.count("\n") == 1


def test_only_rank_0_refuses_a_locked_directory(data_dir, tmp_path):
    """Rank 0 takes the lock once it has set up; a rank still checking the directory then must not mistake that
    lock for another writer's (it did on two H100s: rank 1 exited with status 2 and no message)."""
    from SPA_agent.runs.dir_lock import DirectoryLockedError

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from SPA_agent.runs.dir_lock import DirLock; "
         f"lock = DirLock({str(out)!r}).acquire(); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        trainers = [SftTrainer(compose(overrides(data_dir, out)), rank=rank, world_size=2) for rank in (0, 1)]
        for trainer in trainers:
            trainer.model_path = resolve_model_path("tiny")
            trainer._build_data()
        assert trainers[1]._check_output_dir() is False  # rank 1 checks the rest, not the lock
        with pytest.raises(DirectoryLockedError, match=f"pid {holder.pid} "):
            trainers[0]._check_output_dir()
    finally:
        holder.communicate("")


def test_steps_train_in_training_mode_so_gradient_checkpointing_recomputes(data_dir, tmp_path):
    """A training step runs the model in training mode (from_pretrained leaves eval mode, where transformers skips
    gradient checkpointing): with model.enable_gradient_checkpointing=true each decoder layer runs twice a micro-batch
    (forward, then again in the backward); validation runs in eval mode, once a micro-batch."""
    trainer = SftTrainer(compose(overrides(data_dir, tmp_path, "model.enable_gradient_checkpointing=true")))
    try:
        trainer.setup()
        seen = []
        layer = trainer.model.model.layers[0]
        # a pre-hook: the backward's recomputation stops once it has what it needs, before a forward hook would run
        layer.register_forward_pre_hook(lambda module, args: seen.append(module.training))
        micro_batches = sum(len(rank_plan) for rank_plan in trainer._plan(list(range(4)), trainer.train_data))
        trainer.train_step(list(range(4)))
        assert seen == [True] * (2 * micro_batches)
        seen.clear()
        trainer.validate()
        assert seen and not any(seen)
    finally:
        trainer.cleanup()


def _step_and_gradients(cfg, indices: list[int]) -> tuple[list[int], dict[str, float], dict[str, torch.Tensor]]:
    """One train_step of `indices` from the tiny model's weights: the micro-batch sizes (rows) of its plan, its
    metrics and the gradients it clipped and stepped with."""
    trainer = SftTrainer(cfg)
    try:
        trainer.setup()
        grads = {}
        step = trainer._clip_and_step

        def record_then_step(*args) -> tuple[float, float]:
            grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
            return step(*args)

        trainer._clip_and_step = record_then_step
        sizes = [len(m) for m in trainer._plan(indices, trainer.train_data)[0]]
        return sizes, trainer.train_step(indices), grads
    finally:
        trainer.cleanup()


def test_one_micro_batch_step_equals_the_same_step_in_two(data_dir, tmp_path):
    """The step's loss is the token-summed loss of its micro-batches over the step's trained tokens (train_step's
    scale), so the split does not change it: the same 4 rows in one packed micro-batch (budget 4 x max_length, as
    SmolLM2's preset: a whole step) or in two (budget 192) give the same loss, gradient norm and gradients
    (float32, CPU), only summed in one backward instead of two."""
    runs = {}
    for budget in (192, 4 * 96):
        cfg = compose(overrides(data_dir, tmp_path / str(budget), f"data.max_tokens_per_micro_batch={budget}",
                                "trainer.total_training_steps=1"))
        runs[budget] = _step_and_gradients(cfg, list(range(4)))
    (split_sizes, split, split_grads), (whole_sizes, whole, whole_grads) = runs[192], runs[384]
    assert len(split_sizes) == 2 and whole_sizes == [4]
    assert whole["train/loss_tokens"] == split["train/loss_tokens"]
    assert whole["train/loss"] == pytest.approx(split["train/loss"], rel=1e-6)
    assert whole["train/grad_norm"] == pytest.approx(split["train/grad_norm"], rel=1e-6)
    assert whole_grads.keys() == split_grads.keys() and whole_grads
    for name, grad in split_grads.items():
        torch.testing.assert_close(whole_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_smollm2_preset_sft_runs_a_whole_step_as_one_micro_batch():
    """SmolLM2's SFT as its scripts run it (finetune_ft.sh's stage with the preset's sft_defaults, as run_spa.sh and
    benchmarks/smollm2_sweep.sh pass them) packs at most max_length x train_batch_size = 32,768 tokens a micro-batch:
    any step of 16 rows is one micro-batch. The other models keep the trainer's 16,384 (tiny its 4,096)."""
    from SPA_agent.model_presets import script_models
    from SPA_agent.stages import script_sft_command

    budgets = {}
    for name, row in script_models().items():
        stage = script_sft_command("_2_sokoban", "out", "data", name, "disable", overrides=row.sft_defaults.split())
        assert stage[:2] == ["-m", "sft.spa_sft_trainer"]
        data = compose(stage[2:]).data
        budgets[name] = data.max_tokens_per_micro_batch
        if name == "smollm2-135m":
            assert budgets[name] == 32768 == data.max_length * data.train_batch_size
    assert budgets == {name: 32768 if name == "smollm2-135m" else 4096 if name == "tiny" else 16384
                       for name in script_models()}


def test_one_rank_without_a_process_group_trains_as_with_one(data_dir, tmp_path, monkeypatch):
    """One rank without FSDP sets up no process group (on a GPU, NCCL would build a communicator for collectives
    over one rank). Its losses, gradient norms and weights are bit for bit those of the same run with a gloo group
    of one, set up by the caller, in which every barrier and all-reduce runs (float32, CPU); so are its validation
    loss and the step's one read of the norm and the loss before the optimizer step."""
    import torch.distributed as dist
    from torch.distributed.elastic.utils.distributed import get_free_port

    reductions = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: reductions.append(1) or all_reduce(tensor, *a, **k))
    extra = ("trainer.total_training_steps=3", "trainer.save_freq=0")
    run(compose(overrides(data_dir, tmp_path / "alone", *extra)))
    assert not reductions and not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{get_free_port()}", rank=0, world_size=1)
    run(compose(overrides(data_dir, tmp_path / "group", *extra)))  # its cleanup ends the group
    assert len(reductions) == 3 + 1  # each step's loss, the validation's totals
    alone, group = records(tmp_path / "alone"), records(tmp_path / "group")
    keys = ("step", "train/loss", "train/grad_norm", "train/lr", "train/loss_tokens", "val/loss")
    assert [[r.get(k) for k in keys] for r in alone] == [[r.get(k) for k in keys] for r in group]
    assert alone[-1]["val/loss"] is not None
    weights = [load_file(tmp_path / name / "global_step_3" / "model.safetensors") for name in ("alone", "group")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])

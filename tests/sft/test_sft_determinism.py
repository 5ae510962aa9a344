"""trainer.deterministic: two runs of the same data, config and seed write bit-identical weights; the switch is on
during the run and the process's torch settings come back after it; a value it cannot run with is refused in one
line. The GPU test runs the packed attention in bf16 as GPU runs do."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from sft_fixtures import SYSTEM, synthetic_rows, write_rows

from sft.in_process import compose, run
from sft.spa_sft_trainer import CUBLAS_WORKSPACE, FLASH_ATTN_DETERMINISTIC, RUN_DIR, SftTrainer
from SPA_agent.runs import checkpoints, run_identity
from SPA_agent.runs.metrics_logger import read_metrics


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sftdata")
    write_rows(root / "wm_train.parquet", *synthetic_rows(8, seed=0))
    (root / "data_card.json").write_text("{}")  # a complete dataset
    return root


def overrides(data_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    """8 rows, batch 4, 2 steps, one checkpoint at the end, no validation."""
    return [f"data.train_files={data_dir}/wm_train.parquet", "data.val_files=null", "model.partial_pretrain=tiny",
            f"trainer.default_local_dir={out_dir}", "data.max_length=96", "data.train_batch_size=4",
            "data.max_tokens_per_micro_batch=192", "optim.lr=3e-3", "trainer.total_training_steps=2",
            "trainer.device=cpu", *extra]


def final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoints.saved(out_dir)[-1][1] / "model.safetensors")


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors of `a` that are not bit-identical in `b` (same keys required)."""
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]


def torch_settings() -> tuple:
    """(deterministic algorithms, warn only, cuDNN benchmarking, CUBLAS_WORKSPACE_CONFIG, FLASH_ATTENTION_DETERMINISTIC)"""
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.benchmark, os.environ.get(CUBLAS_WORKSPACE), os.environ.get(FLASH_ATTN_DETERMINISTIC))


@pytest.fixture
def clean_environment(monkeypatch):
    """Neither variable the switch sets is set before the test (monkeypatch puts back what was there)."""
    for name in (CUBLAS_WORKSPACE, FLASH_ATTN_DETERMINISTIC):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def seen_during_steps(monkeypatch):
    """The torch settings observed at each training step of the runs in this test."""
    seen = []
    train_step = SftTrainer.train_step

    def observed(self, indices):
        seen.append(torch_settings())
        return train_step(self, indices)

    monkeypatch.setattr(SftTrainer, "train_step", observed)
    return seen


def test_deterministic_runs_write_identical_weights_with_the_switch_on(data_dir, tmp_path, clean_environment,
                                                                       seen_during_steps, capsys):
    before = torch_settings()
    for name in ("a", "b"):
        run(compose(overrides(data_dir, tmp_path / name, "trainer.deterministic=true")))
        assert torch_settings() == before  # restored after each in-process run
    assert seen_during_steps == [(True, False, False, ":4096:8", "1")] * 4
    assert differing(final_weights(tmp_path / "a"), final_weights(tmp_path / "b")) == []
    assert "sft: deterministic kernels (trainer.deterministic=true, CUBLAS_WORKSPACE_CONFIG=:4096:8)" \
        in capsys.readouterr().out
    assert OmegaConf.load(tmp_path / "a" / "sft_config.yaml").trainer.deterministic is True


def test_the_switch_is_off_by_default_and_keeps_an_accepted_workspace_value(data_dir, tmp_path, monkeypatch,
                                                                            clean_environment, seen_during_steps):
    run(compose(overrides(data_dir, tmp_path / "off", "trainer.total_training_steps=1")))
    monkeypatch.setenv(CUBLAS_WORKSPACE, ":16:8")
    run(compose(overrides(data_dir, tmp_path / "on", "trainer.total_training_steps=1", "trainer.deterministic=true")))
    assert [seen[0] for seen in seen_during_steps] == [False, True]
    assert seen_during_steps[1][3] == ":16:8" and os.environ[CUBLAS_WORKSPACE] == ":16:8"


@pytest.mark.parametrize("extra, environment, message", [
    (["trainer.deterministic=yes"], None, "trainer.deterministic must be true or false, got 'yes'"),
    (["trainer.deterministic=true"], ":0:0",
     "trainer.deterministic=true needs CUBLAS_WORKSPACE_CONFIG unset or one of :4096:8, :16:8, got ':0:0'"),
])
@pytest.mark.parametrize("preflight", [False, True])
def test_values_the_switch_cannot_run_with_are_refused_in_one_line(data_dir, tmp_path, monkeypatch, call_entry,
                                                                   extra, environment, message, preflight):
    """In this process (sft/finetune_ft.sh runs the same entry point, with trainer.preflight_nproc, as a process)."""
    from sft import spa_sft_trainer

    if environment is not None:
        monkeypatch.setenv(CUBLAS_WORKSPACE, environment)
    before = torch_settings()
    check = ["trainer.preflight_nproc=1"] if preflight else []
    code, err = call_entry(spa_sft_trainer, [*overrides(data_dir, tmp_path), *extra, *check])
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1
    assert torch_settings() == before


def test_the_switch_is_part_of_the_run_identity(data_dir, tmp_path):
    identities = [run_identity.build_identity(
        OmegaConf.to_container(compose(overrides(data_dir, tmp_path, f"trainer.deterministic={value}"))), {},
        ignore=RUN_DIR.ignored) for value in ("false", "true")]
    assert identities[0].config["trainer.deterministic"] is False
    assert run_identity.differences(*identities) == ["trainer.deterministic (false -> true)"]


# ------------------------------------------------------------------------------------------------ GPU


def long_rows(n: int, seed: int) -> tuple[list[list[dict]], list[str]]:
    """Rows of several turns, about 300 to 1,500 tiny-tokenizer tokens: packed samples span several of flash
    attention's 128-token blocks, so its backward has partial gradients to add up."""
    rng = random.Random(seed)
    prompts, responses = synthetic_rows(n, seed)
    for prompt in prompts:
        turns = []
        for turn in range(rng.randint(2, 12)):
            state = "".join(rng.choice("#_PXO") for _ in range(16))
            turns += [{"role": "user", "content": f"Turn {turn + 1}:\nState:\n{state}\n"},
                      {"role": "assistant", "content": f"<think> <observation>{state}</observation></think>"
                                                       f"<answer>{rng.choice(['Up', 'Down', 'Left'])}</answer>"}]
        prompt[1:1] = turns
        assert prompt[0] == SYSTEM
    return prompts, responses


def gpu_run(data: Path, out: Path, *extra: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """A short SFT on the GPU as GPU runs go (packed attention, bf16 autocast); its final weights and step losses."""
    run(compose([f"data.train_files={data}/wm_train.parquet", "data.val_files=null", "model.partial_pretrain=small",
                 f"trainer.default_local_dir={out}", "data.max_length=4096", "data.train_batch_size=16",
                 "data.max_tokens_per_micro_batch=4096", "trainer.total_training_steps=4", "trainer.device=cuda",
                 "model.attn_implementation=packed_sdpa", "trainer.seed=3", *extra]))
    return final_weights(out), [r["train/loss"] for r in read_metrics(out / "metrics.jsonl")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_deterministic_sft_writes_identical_weights_and_losses(tmp_path, clean_environment):
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "wm_train.parquet", *long_rows(64, seed=0))
    (data / "data_card.json").write_text("{}")
    (weights_a, losses_a), (weights_b, losses_b) = (gpu_run(data, tmp_path / name, "trainer.deterministic=true")
                                                    for name in ("a", "b"))
    assert len(losses_a) == 4 and losses_a == losses_b
    assert differing(weights_a, weights_b) == []
    weights_c, losses_c = gpu_run(data, tmp_path / "c")  # without the switch: reported only
    changed = differing(weights_a, weights_c)
    largest = max((float((weights_a[k] - weights_c[k]).abs().max()) for k in changed), default=0.0)
    print(f"\nwithout trainer.deterministic: {len(changed)} of {len(weights_a)} tensors differ (largest difference "
          f"{largest:.3g}); losses {'equal' if losses_c == losses_a else 'differ'}: {losses_a} vs {losses_c}")
    seconds = {name: [r["train/step_s"] for r in read_metrics(tmp_path / name / "metrics.jsonl")][1:]
               for name in ("a", "c")}  # steps 2-4: the first compiles and warms up
    print(f"step seconds with the switch {seconds['a']}, without {seconds['c']}")


def test_the_pipelines_early_check_refuses_a_non_boolean_switch():
    """run_spa.sh and the sweeps check SFT settings before stage 1 (SPA_agent/pipeline_check.py) with this function."""
    from sft.config_checks import check_sft_config

    with pytest.raises(ValueError, match="trainer.deterministic must be true or false, got 'yes'"):
        check_sft_config(compose(["trainer.deterministic=yes", "data.train_files=x.parquet"]))

"""The persistent torch.compile cache (SPA_agent/runs/compile_cache.py): defaults under the user's cache directory,
variables the user set are kept, and the SFT and PPO entry points apply it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from SPA_agent.runs.compile_cache import use_persistent_compile_cache

REPO = Path(__file__).resolve().parents[1]

VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in (*VARIABLES, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return monkeypatch


def test_defaults_go_under_the_user_cache_dir(clean_env, tmp_path):
    folder = use_persistent_compile_cache()
    assert folder == tmp_path / ".cache" / "spa_agent" / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"


def test_xdg_cache_home_is_followed(clean_env, tmp_path):
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert use_persistent_compile_cache() == tmp_path / "xdg" / "spa_agent" / "inductor"


def test_user_values_are_kept(clean_env, tmp_path):
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    clean_env.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    clean_env.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    assert use_persistent_compile_cache() == tmp_path / "mine"
    assert [os.environ[name] for name in VARIABLES] == [str(tmp_path / "mine"), "0", "0"]


def test_an_unusable_home_keeps_torch_default(clean_env, tmp_path):
    (tmp_path / "file").write_text("")
    clean_env.setenv("HOME", str(tmp_path / "file"))  # ~/.cache cannot be created under a file
    assert use_persistent_compile_cache() is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_torch_uses_the_folder(clean_env, tmp_path):
    """Inductor's own lookup (what its FX graph, autograd and Triton caches write under) returns our folder."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert Path(cache_dir()) == use_persistent_compile_cache()


def test_sft_entry_point_applies_it(clean_env, tmp_path, call_entry):
    """An SFT run that stops at its first check (a batch size error) has created the folder under HOME (its entry
    point called in this process; tests/sft/test_sft_trainer.py's torchrun tests start it as processes)."""
    from sft import spa_sft_trainer

    code, err = call_entry(spa_sft_trainer, ["data.train_files=x.parquet", "data.packing=false",
                                             "data.train_batch_size=3", "data.micro_batch_size_per_gpu=2",
                                             "trainer.device=cpu"])
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".cache" / "spa_agent" / "inductor")
    assert (tmp_path / ".cache" / "spa_agent" / "inductor").is_dir()


def test_ppo_entry_point_applies_it(clean_env, tmp_path):
    from omegaconf import OmegaConf

    from SPA_agent.trainer.main_ppo import _copy_environment

    _copy_environment(OmegaConf.create({"trainer": {"logger": ["console"]}}))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".cache" / "spa_agent" / "inductor")

"""Stage 1 reruns: a complete dataset is kept when nothing changed, refused when settings differ, and never
damaged by a failed or interrupted rerun; SFT accepts only complete datasets."""

from __future__ import annotations

import os
import socket

import pytest
from omegaconf import OmegaConf

from SPA_agent.config import compose
from SPA_agent.runs.dir_lock import LOCK_FILE, DirectoryLockedError, UnwritableDirectoryError
from SPA_agent.runs.run_identity import IDENTITY_FILE, RunMismatchError
from SPA_agent.selfplay.data_card import CARD_FILE, PARTIAL_DIR, check_dataset_complete
from SPA_agent.selfplay.generate import DATA_FILES, generate, prepare_data_gen_config

SMALL = ["model=tiny", "generator=random", "agent_proxy.max_turn=2", "actor_rollout_ref.rollout.response_length=8",
         "es_manager.train.env_groups=2", "es_manager.train.group_size=2", "es_manager.train.env_configs.n_groups=[2]"]


def config(out_dir, *overrides, num_batches=2):
    cfg = prepare_data_gen_config(compose("_3_frozen_lake", [*SMALL, *overrides]), "_3_frozen_lake")
    OmegaConf.update(cfg, "data_gen.num_batches", num_batches)
    OmegaConf.update(cfg, "data_gen.output_dir", str(out_dir))
    return cfg


def snapshot(out_dir):
    return {p.name: p.read_bytes() for p in out_dir.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    generate(config(out))
    return out


def test_complete_dataset_records_its_identity_and_no_leftovers(dataset):
    names = {p.name for p in dataset.iterdir()}
    assert {*DATA_FILES, CARD_FILE, IDENTITY_FILE} <= names
    assert PARTIAL_DIR not in names and LOCK_FILE not in names
    check_dataset_complete(dataset / "wm_train.parquet")


def test_rerun_with_the_same_settings_keeps_the_dataset(dataset, capsys):
    before = snapshot(dataset)
    card = generate(config(dataset))
    assert "already holds this dataset" in capsys.readouterr().out
    assert snapshot(dataset) == before and card["num_batches"] == 2


def test_rerun_with_other_settings_is_refused_naming_them(dataset):
    before = snapshot(dataset)
    with pytest.raises(RunMismatchError, match=r"seed.train \(10000 -> 123\).*data_gen.resume=false"):
        generate(config(dataset, "seed.train=123"))
    assert snapshot(dataset) == before


def test_failing_rerun_leaves_the_complete_dataset_untouched(dataset):
    before = snapshot(dataset)
    with pytest.raises(FileNotFoundError, match="/nope"):
        generate(config(dataset, "model_path=/nope", "data_gen.resume=false"))
    with pytest.raises(ValueError, match="agent_proxy.max_turn must be >= 1"):
        generate(config(dataset, "agent_proxy.max_turn=0", "data_gen.resume=false"))
    with pytest.raises(ValueError, match="es_manager.train.env_groups must be an integer >= 1, got 0"):
        generate(config(dataset, "es_manager.train.env_groups=0", "es_manager.train.env_configs.n_groups=[0]",
                        "data_gen.resume=false"))
    assert snapshot(dataset) == before and not (dataset / PARTIAL_DIR).exists()


def test_interrupted_fresh_rerun_keeps_the_old_dataset_and_sft_refuses_it(dataset, tmp_path, monkeypatch):
    import shutil

    from SPA_agent.rollout.agent_proxy import LLMAgentProxy

    out = tmp_path / "data"
    shutil.copytree(dataset, out)
    before = snapshot(out)
    real_rollout = LLMAgentProxy.rollout
    calls = []

    def rollout_then_die(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_rollout(self, *args, **kwargs)

    monkeypatch.setattr(LLMAgentProxy, "rollout", rollout_then_die)
    with pytest.raises(KeyboardInterrupt):
        generate(config(out, "seed.train=500", "data_gen.resume=false"))
    assert snapshot(out) == before and (out / PARTIAL_DIR / "batch_00000.json").is_file()
    with pytest.raises(ValueError, match="unfinished data generation"):
        check_dataset_complete(out / "wm_train.parquet")
    monkeypatch.setattr(LLMAgentProxy, "rollout", real_rollout)
    card = generate(config(out, "seed.train=500"))  # resume=true continues the interrupted run
    assert card["seeds"]["first"] == 500 and not (out / PARTIAL_DIR).exists()
    check_dataset_complete(out / "wm_train.parquet")


def test_locked_or_unwritable_directory_is_refused(tmp_path):
    (tmp_path / LOCK_FILE).write_text(f'{{"pid": {os.getppid()}, "host": "{socket.gethostname()}", "started": 0}}')
    with pytest.raises(DirectoryLockedError, match="in use by pid"):
        generate(config(tmp_path))
    with pytest.raises(DirectoryLockedError):
        check_dataset_complete(tmp_path / "wm_train.parquet")
    with pytest.raises(UnwritableDirectoryError, match="cannot write to"):
        generate(config(tmp_path / LOCK_FILE / "data"))


def test_dataset_without_card_is_incomplete(tmp_path):
    (tmp_path / "wm_train.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="no data_card.json"):
        check_dataset_complete(tmp_path / "wm_train.parquet")

"""Relay: a PPO run's record and newest checkpoint cut into parts and restored elsewhere, only over the same
starting model (the end-to-end continuation of a real LoRA run is in tests/trainer/test_wall_time_stop.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from SPA_agent.runs import relay


def _fake_run(root: Path, model: Path) -> Path:
    """A PPO run directory's layout: record files, an older and a newer checkpoint."""
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights" * 1000)
    (model / "config.json").write_text("{}")
    (model / "optimizer.pt").write_bytes(b"not part of the model")
    run = root / "ppo" / "arm"
    for step in (1, 2):
        adapter = run / f"global_step_{step}" / "actor" / "adapter"
        adapter.mkdir(parents=True)
        (adapter / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 40 * step)
        (run / f"global_step_{step}" / "trainer_state.pt").write_bytes(b"state%d" % step)
    (run / "latest_checkpointed_iteration.txt").write_text("2\n")
    (run / "run_identity.json").write_text('{"config": {}}')
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "config.yaml").write_text(f"actor_rollout_ref:\n  model:\n    path: {model}\ncritic:\n  model:\n"
                                     f"    path: {model}\n")
    return run


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_round_trip_carries_the_record_and_the_newest_checkpoint_only(tmp_path):
    run = _fake_run(tmp_path / "a", tmp_path / "sft")
    manifest = relay.pack(tmp_path / "a", ["ppo/arm"], tmp_path / "parts", part_mib=0.004)  # 4 KiB parts
    assert len(manifest["parts"]) > 2 and all(p["bytes"] <= 4194 for p in manifest["parts"])
    assert manifest["runs"][0]["step"] == 2
    assert set(manifest["runs"][0]["models"][str(tmp_path / "sft")]) == {"config.json", "model.safetensors"}
    restored = relay.unpack(tmp_path / "parts", tmp_path / "b")
    assert [r["run"] for r in restored] == ["ppo/arm"]
    expected = {name: data for name, data in _files(run).items() if not name.startswith("global_step_1/")}
    assert _files(tmp_path / "b" / "ppo" / "arm") == expected


def test_a_changed_starting_model_is_refused_and_nothing_is_written(tmp_path):
    _fake_run(tmp_path / "a", tmp_path / "sft")
    relay.pack(tmp_path / "a", ["ppo/arm"], tmp_path / "parts", part_mib=1)
    (tmp_path / "sft" / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(relay.RelayError, match=r"ppo/arm began from other weights .*model\.safetensors.*deterministic"):
        relay.unpack(tmp_path / "parts", tmp_path / "b")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("damage", ["missing", "damaged"])
def test_a_missing_or_damaged_part_is_named(tmp_path, damage):
    _fake_run(tmp_path / "a", tmp_path / "sft")
    relay.pack(tmp_path / "a", ["ppo/arm"], tmp_path / "parts", part_mib=0.004)
    part = tmp_path / "parts" / "relay.tar.001"
    part.unlink() if damage == "missing" else part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(relay.RelayError, match=rf"part relay\.tar\.001 is {damage}|relay\.tar\.001 is {damage}"):
        relay.unpack(tmp_path / "parts", tmp_path / "b")


def test_an_occupied_destination_and_a_non_run_are_refused(tmp_path):
    _fake_run(tmp_path / "a", tmp_path / "sft")
    relay.pack(tmp_path / "a", ["ppo/arm"], tmp_path / "parts", part_mib=1)
    occupied = tmp_path / "b" / "ppo" / "arm"
    occupied.mkdir(parents=True)
    (occupied / "metrics.jsonl").write_text("")
    with pytest.raises(relay.RelayError, match="is not empty"):
        relay.unpack(tmp_path / "parts", tmp_path / "b")
    with pytest.raises(relay.RelayError, match="not a PPO run directory"):
        relay.pack(tmp_path / "a", ["ppo"], tmp_path / "parts2", part_mib=1)


def test_repacking_replaces_the_parts_of_an_earlier_pack(tmp_path):
    run = _fake_run(tmp_path / "a", tmp_path / "sft")
    relay.pack(tmp_path / "a", ["ppo/arm"], tmp_path / "parts", part_mib=0.004)
    (run / "global_step_1").rename(run / "gone")
    manifest = relay.pack(tmp_path / "a", ["ppo/arm"], tmp_path / "parts", part_mib=1)
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["relay.json", "relay.tar.000"]
    assert json.loads((tmp_path / "parts" / "relay.json").read_text()) == manifest


def test_the_command_line_prints_one_line_errors(tmp_path, capsys):
    assert relay.main(["pack", "nowhere", "--root", str(tmp_path), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "not a PPO run directory" in err
    assert relay.main(["unpack", str(tmp_path), "--root", str(tmp_path)]) == 2
    assert "holds no relay.json" in capsys.readouterr().err
    _fake_run(tmp_path / "a", tmp_path / "sft")
    assert relay.main(["pack", "ppo/arm", "--root", str(tmp_path / "a"), "--out", str(tmp_path / "p")]) == 0
    assert "ppo/arm: step 2" in capsys.readouterr().out


def test_check_finds_the_parts_in_the_folders_they_are_carried_in(tmp_path, capsys):
    _fake_run(tmp_path / "a", tmp_path / "sft")
    manifest = relay.pack(tmp_path / "a", ["ppo/arm"], tmp_path / "parts", part_mib=0.004)
    folders = [tmp_path / name for name in ("x", "y", "z")]
    for i, path in enumerate(sorted((tmp_path / "parts").iterdir())):  # relay.json and the parts, spread
        folders[i % 3].mkdir(exist_ok=True)
        path.rename(folders[i % 3] / path.name)
    assert relay.check(folders) == manifest
    assert relay.main(["check", *map(str, folders)]) == 0
    out = capsys.readouterr().out
    assert f"ppo/arm: step 2, from {tmp_path / 'sft'} (model.safetensors " in out
    assert f"{len(manifest['parts'])} parts" in out and "every sha256 checked" in out
    damaged = next(f / "relay.tar.002" for f in folders if (f / "relay.tar.002").is_file())
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    assert relay.main(["check", *map(str, folders)]) == 2
    assert f"part {damaged} is damaged" in capsys.readouterr().err
    without_manifest = [f for f in folders if not (f / "relay.json").is_file()]
    assert relay.main(["check", *map(str, without_manifest)]) == 2
    assert "holds no relay.json" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ('{"runs": [', "is damaged"), ('{"runs": []}', "is not a relay manifest"),
    ('{"runs": [{}], "parts": [], "bytes": 0}', "is not a relay manifest"),
    ('{"runs": [], "parts": [{"name": "relay.json"}], "bytes": 0}', "is not a relay manifest"),
    ('{"runs": [{"run": "r", "step": 1, "models": {"m": "ab"}}], "parts": [], "bytes": 0}',
     "is not a relay manifest")])
def test_a_damaged_or_foreign_manifest_is_one_line(tmp_path, capsys, text, message):
    (tmp_path / "relay.json").write_text(text)
    assert relay.main(["check", str(tmp_path)]) == 2
    assert relay.main(["unpack", str(tmp_path), "--root", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count(f"relay.json {message}") == 2 and err.count("\n") == 2 and "Traceback" not in err


def test_check_checks_every_copy_of_a_part_or_manifest_in_several_folders(tmp_path, capsys):
    """Folders carried together into one overwrite one another's copies: a stale copy anywhere is named, even where
    the first folder's copy is good."""
    _fake_run(tmp_path / "a", tmp_path / "sft")
    relay.pack(tmp_path / "a", ["ppo/arm"], tmp_path / "x", part_mib=0.004)
    (tmp_path / "y").mkdir()
    stale = tmp_path / "y" / "relay.tar.001"
    stale.write_bytes(b"x" + (tmp_path / "x" / "relay.tar.001").read_bytes()[1:])
    folders = [str(tmp_path / "x"), str(tmp_path / "y")]
    assert relay.main(["check", *folders]) == 2
    assert f"part {stale} is damaged or stale" in capsys.readouterr().err
    stale.unlink()
    (tmp_path / "y" / "relay.json").write_text((tmp_path / "x" / "relay.json").read_text().replace("2", "3"))
    assert relay.main(["check", *folders]) == 2
    assert f"{tmp_path / 'x' / 'relay.json'} and {tmp_path / 'y' / 'relay.json'} differ" in capsys.readouterr().err
    (tmp_path / "y" / "relay.json").write_bytes((tmp_path / "x" / "relay.json").read_bytes())
    assert relay.main(["check", *folders, folders[0]]) == 0

"""Run identity: what is compared, what is ignored, and the one-line mismatch message."""

import pytest

from SPA_agent.runs import run_identity as ri


def _identity(lr=1e-4, data="abc", logger=("console",)):
    config = {"optim": {"lr": lr, "betas": [0.9, 0.95]}, "trainer": {"logger": list(logger), "seed": 1}}
    return ri.build_identity(config, {"data": data}, ignore=["trainer.logger"])


def test_flatten_uses_dotted_keys_and_keeps_lists_whole():
    assert ri.flatten({"a": {"b": 1, "c": {"d": None}}, "e": [1, 2], "f": {}}) == \
        {"a.b": 1, "a.c.d": None, "e": [1, 2], "f": {}}


def test_ignored_and_included_keys():
    identity = ri.build_identity({"a": {"x": 1, "y": 2}, "b": 3, "c": {"z": 4}}, {}, ignore=["a.y"],
                                 include=["a", "c.*"])
    assert identity.config == {"a.x": 1, "c.z": 4}


def test_same_settings_match_and_ignored_keys_do_not_count(tmp_path):
    ri.record(tmp_path, _identity())
    assert ri.check(tmp_path, _identity(logger=("console", "wandb")), "pass x") is True


def test_no_record_means_nothing_to_resume(tmp_path):
    assert ri.check(tmp_path, _identity(), "pass x") is False


def test_mismatch_names_the_keys_and_inputs_that_differ(tmp_path):
    ri.record(tmp_path, _identity())
    with pytest.raises(ri.RunMismatchError) as err:
        ri.check(tmp_path, _identity(lr=1e-5, data="def"), "pass trainer.resume=disable")
    message = str(err.value)
    assert "optim.lr (0.0001 -> 1e-05)" in message and "input data (checksum differs)" in message
    assert "pass trainer.resume=disable" in message and "another output directory" in message
    assert "\n" not in message and "seed" not in message


def test_code_version_is_compared_but_git_commit_is_not(tmp_path):
    old = _identity()
    ri.record(tmp_path, ri.RunIdentity(old.config, old.inputs, old.code_version, git_commit="0" * 40))
    assert ri.check(tmp_path, old, "x")
    ri.record(tmp_path, ri.RunIdentity(old.config, old.inputs, "0.0.1", old.git_commit))
    with pytest.raises(ri.RunMismatchError, match=r"code version \(0.0.1 -> "):
        ri.check(tmp_path, old, "x")


def test_file_checksum_full_and_sampled(tmp_path, monkeypatch):
    small = tmp_path / "a.bin"
    small.write_bytes(b"x" * 1000)
    import hashlib

    assert ri.file_checksum(small) == hashlib.sha256(b"x" * 1000).hexdigest()
    monkeypatch.setattr(ri, "FULL_HASH_LIMIT", 100)
    monkeypatch.setattr(ri, "SAMPLE_BYTES", 10)
    big = tmp_path / "b.bin"
    big.write_bytes(b"y" * 500)
    sampled = ri.file_checksum(big)
    big.write_bytes(b"y" * 499 + b"z")  # the tail changes
    assert ri.file_checksum(big) != sampled


def test_model_checksum_ignores_optimizer_state_but_not_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"w1")
    before = ri.model_checksum(str(tmp_path))
    (tmp_path / "optimizer.pt").write_bytes(b"o")
    assert ri.model_checksum(str(tmp_path)) == before
    (tmp_path / "model.safetensors").write_bytes(b"w2")
    assert ri.model_checksum(str(tmp_path)) != before
    assert ri.model_checksum("Qwen/Qwen2.5-0.5B-Instruct") == "hub:Qwen/Qwen2.5-0.5B-Instruct"


def test_corrupt_record_is_a_user_error(tmp_path):
    (tmp_path / ri.IDENTITY_FILE).write_text("not json")
    with pytest.raises(ValueError, match="is not a run identity"):
        ri.check(tmp_path, _identity(), "x")

"""Run identity: what determines the content of an output directory, kept in `<dir>/run_identity.json`.

Every stage that writes a resumable directory (self-play data, SFT checkpoints, PPO runs) computes its identity
before writing anything: the composed config minus the keys that do not change the content (logging, progress,
the output directory itself, the resume switch), a checksum of each input (data files, the starting model) and
the package version. A rerun continues a directory only when the recorded identity equals the new one;
otherwise `check` raises `RunMismatchError`, one line naming what differs and how to start fresh. The git
commit is recorded too, as provenance only: a fix between an interruption and its resume should not block it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from SPA_agent.runs import atomic_io

IDENTITY_FILE = "run_identity.json"
#: files at most this large are hashed whole; larger ones by size and their first and last SAMPLE_BYTES
FULL_HASH_LIMIT = 64 * 2**20
SAMPLE_BYTES = 8 * 2**20
#: files of a model directory that are not part of the model (training state of a checkpoint)
MODEL_FILES_SKIPPED = ("optimizer.pt", "trainer_state.pt")
MAX_LISTED = 6  # differing keys named in the message


class RunMismatchError(ValueError):
    """The output directory holds a run with another identity (a user error: one line, exit status 2)."""


@dataclass(frozen=True)
class RunIdentity:
    """`config`: dotted key → value (content-relevant keys only); `inputs`: name → checksum; `code_version`:
    the package version; `git_commit`: provenance, not compared."""

    config: dict[str, Any]
    inputs: dict[str, str]
    code_version: str
    git_commit: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}, "c": [1, 2]}` → `{"a.b": 1, "c": [1, 2]}` (lists are leaves)."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def _matches(key: str, patterns: Iterable[str]) -> bool:
    """`key` equals a pattern (fnmatch syntax) or lies under one (`trainer` covers `trainer.logger`)."""
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(key, p + ".*") for p in patterns)


def build_identity(config: Mapping, inputs: Mapping[str, str], ignore: Iterable[str] = (),
                   include: Iterable[str] | None = None) -> RunIdentity:
    """The identity of a run with the resolved `config` (plain dict) and input checksums. Keys under `ignore`
    are dropped; when `include` is given, only keys under it are kept."""
    ignore, include = tuple(ignore), None if include is None else tuple(include)
    flat = {key: value for key, value in flatten(config).items()
            if not _matches(key, ignore) and (include is None or _matches(key, include))}
    return RunIdentity(config=flat, inputs=dict(inputs), code_version=code_version(), git_commit=git_commit())


def code_version() -> str:
    try:
        return metadata.version("spa-agent")
    except metadata.PackageNotFoundError:
        return "unknown"


def git_commit() -> str | None:
    """The commit of the checkout this package runs from, if it is a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


# --- checksums ----------------------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    """sha256 of the whole file."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_checksum(path: Path) -> str:
    """sha256 of the file; above FULL_HASH_LIMIT, of its size and first and last SAMPLE_BYTES (model weights)."""
    path = Path(path)
    size = path.stat().st_size
    if size <= FULL_HASH_LIMIT:
        return file_sha256(path)
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(SAMPLE_BYTES))
        f.seek(size - SAMPLE_BYTES)
        digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def files_checksum(paths: Iterable[Path]) -> str:
    """One checksum over several files (names are not part of it: moving the data does not change it)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(file_checksum(path).encode())
    return digest.hexdigest()


def model_files(path: Path) -> list[Path]:
    """The top-level files of a local model directory that make the model (weights, config, tokenizer; not the
    optimizer state of a checkpoint), by name."""
    return sorted(p for p in Path(path).iterdir() if p.is_file() and p.name not in MODEL_FILES_SKIPPED)


def model_checksum(model_path: str) -> str:
    """`sha256:<hex>` over the top-level files of a local model directory (weights, config, tokenizer; not the
    optimizer state of a checkpoint), or `hub:<id>` for a Hub id that is not a local directory."""
    from SPA_agent.model_presets import resolve_model_path

    path = Path(resolve_model_path(str(model_path)))
    if not path.is_dir():
        return f"hub:{model_path}"
    digest = hashlib.sha256()
    for file in model_files(path):
        digest.update(f"{file.name}:{file_checksum(file)}\n".encode())
    return f"sha256:{digest.hexdigest()}"


# --- the record ---------------------------------------------------------------------------------------
def read(directory: Path) -> RunIdentity | None:
    path = Path(directory) / IDENTITY_FILE
    if not path.is_file():
        return None
    try:
        return RunIdentity(**json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path} is not a run identity ({err}); delete it, or start fresh") from None


def record(directory: Path, identity: RunIdentity) -> None:
    atomic_io.write_json(Path(directory) / IDENTITY_FILE, identity.as_dict())


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def differences(old: RunIdentity, new: RunIdentity) -> list[str]:
    """What differs, one phrase per key: `optim.lr (0.0001 -> 1e-05)`, `input data (checksum differs)`."""
    found = []
    for key in sorted(old.config.keys() | new.config.keys()):
        before, after = old.config.get(key, "<unset>"), new.config.get(key, "<unset>")
        if before != after:
            found.append(f"{key} ({_short(before)} -> {_short(after)})")
    for name in sorted(old.inputs.keys() | new.inputs.keys()):
        if old.inputs.get(name) != new.inputs.get(name):
            found.append(f"input {name} (checksum differs)")
    if old.code_version != new.code_version:
        found.append(f"code version ({old.code_version} -> {new.code_version})")
    return found


def check(directory: Path, identity: RunIdentity, fresh_hint: str) -> bool:
    """True when `directory` records `identity` (its run may be continued), False when it records none.
    Raises RunMismatchError naming the differences; `fresh_hint` says how to start fresh (e.g. the override)."""
    recorded = read(directory)
    if recorded is None:
        return False
    diff = differences(recorded, identity)
    if diff:
        listed = ", ".join(diff[:MAX_LISTED]) + (f" and {len(diff) - MAX_LISTED} more" if len(diff) > MAX_LISTED
                                                 else "")
        raise RunMismatchError(f"{directory} holds a run made with other settings: {listed}. To replace it "
                               f"{fresh_hint}; or choose another output directory")
    return True


# --- a stage's output directory -----------------------------------------------------------------------
def owned_files(directory: Path, owned: Iterable[str]) -> list[Path]:
    """The paths in `directory` matching the stage's own output patterns (`global_step_*`, `metrics.jsonl`)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted({path for pattern in owned for path in directory.glob(pattern)})


def check_run_dir(directory: Path, identity: RunIdentity, resume: bool, owned: Iterable[str],
                  fresh_hint: str) -> bool:
    """Whether the run in `directory` may be continued (read-only). With `resume`, a run of another identity,
    or outputs with no recorded identity (an older version's), raise RunMismatchError; without, nothing is
    continued and `reset_run_dir` replaces what is there."""
    if not resume:
        return False
    if check(directory, identity, fresh_hint):
        return True
    if owned_files(directory, [p for p in owned if p != IDENTITY_FILE]):
        raise RunMismatchError(f"{directory} holds outputs but no {IDENTITY_FILE} (an older version's run); to "
                               f"replace them {fresh_hint}; or choose another output directory")
    return False


def reset_run_dir(directory: Path, identity: RunIdentity, owned: Iterable[str]) -> None:
    """Start a fresh run: remove the stage's own outputs (other files are left alone) and record `identity`."""
    for path in owned_files(directory, owned):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    record(directory, identity)

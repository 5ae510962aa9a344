"""Carry PPO runs from one machine to the next in parts of a few MB: a relay.

A rented GPU machine is given back after half an hour and returns at most 64 MiB a call (docs/relay.md). A run
of hundreds of steps then needs several machines. What a run resumes from is small when its roles are LoRA
adapters saved without merged weights (`trainer.save_merged_lora=False`, ~60 MB for SmolLM2-135M at rank 8), so:

    python -m SPA_agent.runs.relay pack --root /tmp --out relay table2_wm/ppo/_2_sokoban/spa_lora_s0 ...
    python -m SPA_agent.runs.relay check relay          # here, before carrying them: every part's sha256
    python -m SPA_agent.runs.relay unpack relay --root /tmp

`pack` writes one tar of each run's record (run_identity.json, metrics.jsonl, config.yaml, the latest-step file)
and its newest checkpoint, paths relative to `--root`, cut into parts of `--part-mib` MiB (`relay.tar.000`, ...),
and `relay.json`: each part's sha256, and each run's step and the sha256 of every file of its starting models. The
parts travel in as many calls as they need. `unpack` checks every part, then that each run's starting models (at
the paths the run was configured with) hold the same bytes as where the run began, and only then writes the runs
under `--root`: adapters continued over other base weights would be another model. The PPO command of the run,
unchanged and with resume_mode=auto, then continues it (its run identity checks the settings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from SPA_agent.runs import checkpoints
from SPA_agent.runs.run_identity import IDENTITY_FILE, file_sha256, model_files

MANIFEST = "relay.json"
PART_PREFIX = "relay.tar."
#: a run's record beside its checkpoints (what `pack` carries besides the newest checkpoint)
RECORD_FILES = (IDENTITY_FILE, "metrics.jsonl", "config.yaml", checkpoints.LATEST_FILE)
#: the config keys of a PPO run's starting models
MODEL_KEYS = ("actor_rollout_ref.model.path", "critic.model.path")


class RelayError(ValueError):
    """A user-facing problem with the runs or the parts (one line, exit status 2)."""


def model_files_sha256(model_dir: str) -> dict[str, str]:
    """name → sha256 of every top-level file of a model directory (a checkpoint's training state excluded); a
    preset's name (`tiny`, `smollm2-135m`) stands for its directory."""
    from SPA_agent.model_presets import resolve_model_path

    path = Path(resolve_model_path(model_dir))
    if not path.is_dir():
        raise RelayError(f"the starting model {model_dir} is not a directory here")
    return {p.name: file_sha256(p) for p in model_files(path)}


def _hashed_once(hashed: dict[str, dict[str, str]], model: str) -> dict[str, str]:
    """`model_files_sha256(model)`, computed once per call of pack or unpack (arms share their SFT checkpoint)."""
    if model not in hashed:
        hashed[model] = model_files_sha256(model)
    return hashed[model]


def starting_models(run_dir: Path) -> list[str]:
    """The distinct starting-model directories of a PPO run, from its config.yaml."""
    config = OmegaConf.load(run_dir / "config.yaml")
    return list(dict.fromkeys(str(OmegaConf.select(config, key)) for key in MODEL_KEYS
                              if OmegaConf.select(config, key) is not None))


def _run_files(root: Path, run: str) -> tuple[int, list[Path]]:
    """The newest step of run `run` (relative to root) and the files to carry, relative to root."""
    run_dir = root / run
    if not (run_dir / "config.yaml").is_file() or not (run_dir / IDENTITY_FILE).is_file():
        raise RelayError(f"{run_dir} is not a PPO run directory (no config.yaml and {IDENTITY_FILE})")
    step = checkpoints.latest_step(run_dir)
    if step is None:
        raise RelayError(f"{run_dir} has no checkpoint to carry yet")
    files = [run_dir / name for name in RECORD_FILES if (run_dir / name).is_file()]
    files += sorted(p for p in checkpoints.step_dir(run_dir, step).rglob("*") if p.is_file())
    return step, [f.relative_to(root) for f in files]


def pack(root: Path, runs: Sequence[str], out: Path, part_mib: float) -> dict:
    """Write the parts and the manifest of `runs` (directories relative to `root`) into `out`; the manifest."""
    if part_mib <= 0:
        raise RelayError(f"--part-mib must be positive, got {part_mib}")
    entries, files, hashed = [], [], {}
    for run in runs:
        step, run_files = _run_files(root, run)
        models = {model: _hashed_once(hashed, model) for model in starting_models(root / run)}
        entries.append({"run": run, "step": step, "models": models})
        files += run_files
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{PART_PREFIX}*"):
        stale.unlink()
    size, parts = int(part_mib * 2**20), []
    with tempfile.TemporaryFile() as stream:  # the tar on disk, then cut: a run's checkpoint may not fit in memory
        with tarfile.open(fileobj=stream, mode="w") as tar:
            for name in files:
                tar.add(root / name, arcname=name.as_posix(), recursive=False)
        total = stream.tell()
        stream.seek(0)
        while data := stream.read(size):
            part = out / f"{PART_PREFIX}{len(parts):03d}"
            part.write_bytes(data)
            parts.append({"name": part.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"runs": entries, "parts": parts, "bytes": total}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _checked_parts(parts_dirs: Sequence[Path], manifest: dict) -> list[Path]:
    """Every part of the manifest, found in one of `parts_dirs`, with its sha256 checked; a part in several of them
    is checked in each (folders carried together into one overwrite one another's copies)."""
    paths, parts_dirs = [], list(dict.fromkeys(parts_dirs))
    for part in manifest["parts"]:
        found = [d / part["name"] for d in parts_dirs if (d / part["name"]).is_file()]
        if not found:
            raise RelayError(f"part {part['name']} is missing from {', '.join(map(str, parts_dirs))} "
                             f"({len(manifest['parts'])} parts in {MANIFEST})")
        for path in found:
            if file_sha256(path) != part["sha256"]:
                if len(found) == 1:
                    raise RelayError(f"part {path} is damaged (its sha256 differs from {MANIFEST}'s); carry it again")
                others = ", ".join(str(other) for other in found if other != path)
                raise RelayError(f"part {path} is damaged or stale (its sha256 differs from {MANIFEST}'s; the part "
                                 f"is also in {others}): remove it or carry it again")
        paths.append(found[0])
    return paths


def _manifest(parts_dirs: Sequence[Path]) -> dict:
    """The relay.json of `parts_dirs`; where several of them hold one, every copy must hold the same bytes."""
    copies = [d / MANIFEST for d in dict.fromkeys(parts_dirs) if (d / MANIFEST).is_file()]
    if not copies:
        where = str(parts_dirs[0]) if len(parts_dirs) == 1 else f"none of {', '.join(map(str, parts_dirs))}"
        raise RelayError(f"{where} holds no {MANIFEST}: nothing was packed there")
    path = copies[0]
    for other in copies[1:]:
        if other.read_bytes() != path.read_bytes():
            raise RelayError(f"{path} and {other} differ: keep the {MANIFEST} packed with these parts, remove the "
                             "other")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RelayError(f"{path} is damaged ({error}); carry it again") from None
    if not _is_manifest(manifest):
        raise RelayError(f"{path} is not a relay manifest (written by `relay pack`): its runs, parts or bytes are "
                         "missing or of another form")
    return manifest


def _is_manifest(manifest) -> bool:
    """Whether `manifest` has the form `pack` writes: what check and unpack read of it."""
    if not (isinstance(manifest, dict) and isinstance(manifest.get("runs"), list)
            and isinstance(manifest.get("parts"), list) and isinstance(manifest.get("bytes"), int)):
        return False
    parts_ok = all(isinstance(part, dict) and isinstance(part.get("name"), str) and isinstance(part.get("sha256"), str)
                   for part in manifest["parts"])
    runs_ok = all(isinstance(entry, dict) and isinstance(entry.get("run"), str) and isinstance(entry.get("step"), int)
                  and isinstance(entry.get("models"), dict)
                  and all(isinstance(files, dict) for files in entry["models"].values())
                  for entry in manifest["runs"])
    return parts_ok and runs_ok


def check(parts_dirs: Sequence[Path]) -> dict:
    """Check every part of a relay spread over `parts_dirs` (e.g. the folders it is carried in); its manifest.
    The starting models are not checked: they exist only where the runs continue (`unpack` checks them)."""
    manifest = _manifest(parts_dirs)
    _checked_parts(parts_dirs, manifest)
    return manifest


def unpack(parts_dir: Path, root: Path) -> list[dict]:
    """Check the parts and every run's starting models, then write the runs under `root`; the manifest's runs."""
    manifest = _manifest([parts_dir])
    parts, hashed = _checked_parts([parts_dir], manifest), {}
    for entry in manifest["runs"]:
        for model, expected in entry["models"].items():
            here = _hashed_once(hashed, model)
            if here != expected:
                differ = sorted(name for name in expected.keys() | here.keys() if expected.get(name) != here.get(name))
                raise RelayError(f"{entry['run']} began from other weights than {model} holds here (differing: "
                                 f"{', '.join(differ)}); its adapters would continue another model. Remake the "
                                 "starting model bit for bit (for an SFT checkpoint: trainer.deterministic=true, "
                                 "docs/sft.md) or start the run afresh")
        run_dir = root / entry["run"]
        if run_dir.exists() and any(run_dir.iterdir()):
            raise RelayError(f"{run_dir} exists and is not empty: move it away to unpack the carried run there")
    with tempfile.TemporaryFile() as stream:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, stream)
        stream.seek(0)
        with tarfile.open(fileobj=stream, mode="r") as tar:
            tar.extractall(root, filter="data")
    return manifest["runs"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m SPA_agent.runs.relay", description=__doc__.split("\n\n")[0],
                                     epilog="docs/relay.md: how the Table 2 job carries LoRA runs between leases.")
    commands = parser.add_subparsers(dest="command", required=True)
    packer = commands.add_parser("pack", help="cut runs' newest checkpoints and records into parts")
    packer.add_argument("runs", nargs="+", help="PPO run directories, relative to --root")
    packer.add_argument("--root", type=Path, required=True, help="the directory the run paths are relative to")
    packer.add_argument("--out", type=Path, required=True, help="where the parts and relay.json go")
    packer.add_argument("--part-mib", type=float, default=15.0, help="size of a part in MiB (default 15)")
    unpacker = commands.add_parser("unpack", help="check the parts and the starting models, then restore the runs")
    unpacker.add_argument("parts", type=Path, help="the directory holding relay.json and the parts")
    unpacker.add_argument("--root", type=Path, required=True, help="where the runs go (their paths are relative)")
    checker = commands.add_parser("check", help="check every part (spread over folders) and list the runs")
    checker.add_argument("parts", type=Path, nargs="+", help="the directories holding relay.json and the parts")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            manifest = check(args.parts)
            for entry in manifest["runs"]:
                models = "; ".join(f"{model} (model.safetensors {files.get('model.safetensors', '?')})"
                                   for model, files in entry["models"].items())
                print(f"{entry['run']}: step {entry['step']}, from {models}")
            print(f"{len(manifest['parts'])} parts, {manifest['bytes'] / 2**20:.1f} MiB: every sha256 checked")
        elif args.command == "pack":
            manifest = pack(args.root, args.runs, args.out, args.part_mib)
            for entry in manifest["runs"]:
                print(f"{entry['run']}: step {entry['step']}")
            print(f"{len(manifest['parts'])} parts, {manifest['bytes'] / 2**20:.1f} MiB, in {args.out}")
        else:
            for entry in unpack(args.parts, args.root):
                print(f"{args.root / entry['run']}: step {entry['step']}, starting models checked")
    except (RelayError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

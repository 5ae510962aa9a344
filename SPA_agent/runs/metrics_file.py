"""Reading a metrics.jsonl (one JSON object per line, appended step by step by the PPO and SFT loggers).

A run killed while appending can leave its last line cut short: that line is dropped (the resumed run logs the
step again). A bad line anywhere else is a user-facing error naming the file and the line. A `.gz` file is read as
the plain file it compresses (docs/results keeps the runs' files gzip-compressed).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from SPA_agent.runs.atomic_io import write_jsonl


def jsonl_in(directory: Path, name: str) -> Path | None:
    """`directory/name`, or its gzip-compressed `name.gz` (docs/results keeps those); None if neither is a file."""
    return next((path for path in (directory / name, directory / f"{name}.gz") if path.is_file()), None)


def read_records(path: Path) -> tuple[list[dict], bool]:
    """(records, intact): the JSON objects of `path` in order ([] if it does not exist); `intact` is False when a
    cut-short last line was dropped, so a writer must rewrite the file before appending."""
    path = Path(path)
    if not path.exists():
        return [], True
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    lines = data.decode("utf-8").splitlines()
    records, intact = [], True
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                intact = False
                continue
            raise ValueError(f"{path}:{number} is not a JSON line ({err.msg}); fix or delete that line") from None
    return records, intact


def truncate_after(path: Path, step: int) -> None:
    """Drop the records of steps after `step` (a resumed run logs them again) and a cut-short last line, rewriting
    the file atomically; a file without either is left as it is."""
    records, intact = read_records(path)
    if not intact or any(r["step"] > step for r in records):
        write_jsonl(path, [r for r in records if r["step"] <= step])

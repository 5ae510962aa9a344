"""Atomic file writes: write a hidden temporary file next to the target, then `os.replace` it into place, so an
interrupted run never leaves a half-written file under the final name (DESIGN §3)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def write_atomic(path: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_path)`, then rename the temporary file to `path` (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: Path, text: str) -> Path:
    """UTF-8 text, atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: Path, data: Any) -> Path:
    """Indented JSON with sorted keys (so equal data gives equal bytes), atomically."""
    return write_text(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_jsonl(path: Path, records: list[Any]) -> Path:
    """One compact JSON document per line, atomically."""
    lines = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in records)
    return write_text(path, lines)


def write_parquet(path: Path, table: pa.Table) -> Path:
    """A parquet file without timestamps or statistics that vary between runs, atomically."""
    return write_atomic(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def read_json(path: Path, remedy: str) -> Any:
    """The JSON document in `path`; a damaged one (cut short, not JSON, not UTF-8) raises ValueError naming the file
    and what to do about it (`remedy`), not the decoder's bare "Expecting ',' delimiter"."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is damaged (not JSON: {err}); {remedy}") from None


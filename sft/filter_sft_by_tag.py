"""Keep the SFT rows whose response is in the world-model format (spec §8, used for the released FrozenLake and
Sudoku data).

A row is kept when its `response` has a `<think>…</think>` block that starts before the first `<answer>…</answer>`
block, and the think body holds an `<observation>…</observation>` block followed (later) by a
`<prediction>…</prediction>` block (tags case-insensitive; `SPA_agent.selfplay.worldmodel.has_worldmodel_format`). Optional length bounds apply to the response in
characters. Duplicate (prompt, response) pairs are dropped unless `--no-dedup`; prompts may be arrays of chat
messages, so the key is a hash of their canonical JSON. Every column and the schema of the input are kept.

    python sft/filter_sft_by_tag.py --input sftdata/_3_frozen_lake-1.5B-text_with_coordinates \
        --output sftdata/_3_frozen_lake-1.5B-text_with_coordinates-filtered --min-len 50
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from SPA_agent.runs import atomic_io
from SPA_agent.runs.dir_lock import DirLock
from SPA_agent.selfplay.data_card import CARD_FILE, describe_files
from SPA_agent.selfplay.worldmodel import has_worldmodel_format
from SPA_agent.stages import DATA_FILES, SPLITS


def row_key(prompt: Any, response: str) -> str:
    """Stable hash of a (prompt, response) pair; the prompt may be a string or a list of message dicts."""
    canonical = json.dumps([prompt, response], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass
class FilterStats:
    """Row counts of one split: read, dropped by format, by length, as duplicates, and kept."""

    total: int = 0
    bad_format: int = 0
    bad_length: int = 0
    duplicate: int = 0
    kept: int = 0


def filter_table(
    table: pa.Table, min_len: int | None = None, max_len: int | None = None, dedup: bool = True
) -> tuple[pa.Table, FilterStats]:
    """Rows of `table` (needs `prompt` and `response` columns) that pass the format, length and dedup checks,
    in their original order; the schema is unchanged."""
    for column in ("prompt", "response"):
        if column not in table.column_names:
            raise ValueError(f"input has no {column!r} column (columns: {table.column_names}); is it SFT data?")
    prompts, responses = table.column("prompt").to_pylist(), table.column("response").to_pylist()
    stats, keep, seen = FilterStats(total=table.num_rows), [], set()
    for prompt, response in zip(prompts, responses):
        response = response or ""
        if not has_worldmodel_format(response):
            stats.bad_format += 1
        elif (min_len is not None and len(response) < min_len) or (max_len is not None and len(response) > max_len):
            stats.bad_length += 1
        elif dedup and (key := row_key(prompt, response)) in seen:
            stats.duplicate += 1
        else:
            if dedup:
                seen.add(key)
            keep.append(True)
            continue
        keep.append(False)
    stats.kept = sum(keep)
    return table.filter(pa.array(keep, type=pa.bool_())), stats


def filter_dir(
    input_dir: Path, output_dir: Path, min_len: int | None, max_len: int | None, dedup: bool
) -> dict[str, FilterStats]:
    """Filter `<input_dir>/wm_{train,val}.parquet` into `<output_dir>/wm_{train,val}.parquet`, then write the
    output's data card (the input's card, if any, under `source_card`, plus the filter and its counts): like a
    stage-1 dataset, the output counts as complete only once its card is there."""
    paths = {split: input_dir / f"{split}.parquet" for split in SPLITS}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"missing input file(s) {missing}: pass the directory holding {'/'.join(SPLITS)}.parquet")
    if output_dir.resolve() == input_dir.resolve():
        raise ValueError("--output must differ from --input (the inputs would be overwritten)")
    if min_len is not None and max_len is not None and min_len > max_len:
        raise ValueError(f"--min-len {min_len} is greater than --max-len {max_len}: no response could pass")
    tables, stats = {}, {}
    for split, path in paths.items():
        tables[split], stats[split] = filter_table(pq.read_table(path), min_len, max_len, dedup)
    empty = [split for split, s in stats.items() if s.kept == 0 and s.total > 0]
    train = SPLITS[0]
    if train in empty:
        raise ValueError(f"no row of {paths[train]} passes the filter ({stats[train]}); loosen "
                         "--min-len/--max-len")
    with DirLock(output_dir):
        (output_dir / CARD_FILE).unlink(missing_ok=True)
        for split, table in tables.items():
            atomic_io.write_parquet(output_dir / f"{split}.parquet", table)
        source_card = input_dir / CARD_FILE
        atomic_io.write_json(output_dir / CARD_FILE, {
            "stage": "filtered SFT data (sft/filter_sft_by_tag.py)", "source": str(input_dir),
            "source_card": json.loads(source_card.read_text(encoding="utf-8")) if source_card.is_file() else None,
            "filter": {"min_len": min_len, "max_len": max_len, "dedup": dedup},
            "splits": {split: asdict(s) for split, s in stats.items()},
            "files": describe_files(output_dir, DATA_FILES)})
    return stats


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Keep SFT rows whose response has <think> with <observation> before <prediction>, "
        "before <answer> (spec §8).")
    parser.add_argument("--input", required=True, type=Path, help=f"directory with {' and '.join(DATA_FILES)}")
    parser.add_argument("--output", required=True, type=Path, help="directory for the filtered splits")
    parser.add_argument("--min-len", type=int, default=None, help="drop responses shorter than this (characters)")
    parser.add_argument("--max-len", type=int, default=None, help="drop responses longer than this (characters)")
    parser.add_argument("--no-dedup", action="store_true", help="keep duplicate (prompt, response) rows")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        stats = filter_dir(args.input, args.output, args.min_len, args.max_len, dedup=not args.no_dedup)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split, s in stats.items():
        print(json.dumps({"split": split, **s.__dict__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

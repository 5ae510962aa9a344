"""SFT dataset: parquet rows (spec §8 schema) → token ids and a loss mask.

Each row has `prompt` (list<struct<content, role>>: the chat up to the assistant turn) and `response` (the
assistant message); other columns (ours or the released data's) are ignored. Rows are rendered by
`sft.loss_targets.build_text` (the one place that decides which tokens train), tokenized once at
construction (all rows at once: `sft.batch_encode`), and truncated with masks kept aligned to ids (fixing spec
§12.15). What truncation removed is kept in `SpaSftDataset.truncation_report`, so a run can say how many rows were
cut and by how much.

Conventions: `input_ids` (T,) = prompt ids followed by target ids; `loss_mask` (T,) is 1 where
`input_ids[i]` is a trained target, i.e. the logits at position i−1 are scored against it. Position 0 is never
trained.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sft.batch_encode import encode_texts, encode_with_offsets
from sft.loss_targets import (
    LossTarget,
    build_text,
    end_of_turn_token,
    placeholder_ids,
    released_off_by_one,
    token_loss_mask,
)


class Truncation(str, enum.Enum):
    """Config value `data.truncation`: what to do with a row longer than `data.max_length` tokens."""

    LEFT = "left"  # keep the last max_length tokens (the prompt's start is dropped); the original's default
    RIGHT = "right"  # keep the first max_length tokens (the response's end is dropped)
    ERROR = "error"  # refuse the data set

    @classmethod
    def parse(cls, value: str) -> Truncation:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"data.truncation={value!r} is not one of {[m.value for m in cls]}") from None


@dataclass(frozen=True)
class TruncationReport:
    """What `data.truncation` did to one data set.

    cuts: tokens removed from each truncated row; trained_tokens_cut: loss-mask tokens among them, summed
    over rows (0 under `left` unless a response alone exceeds max_length).
    """

    rows: int
    longest: int
    max_length: int
    mode: str
    cuts: tuple[int, ...] = ()
    trained_tokens_cut: int = 0

    def as_dict(self) -> dict[str, float | int | str]:
        """Flat numbers for a JSON file or a metrics record."""
        return {"rows": self.rows, "longest_row_tokens": self.longest, "max_length": self.max_length,
                "truncation": self.mode, "rows_truncated": len(self.cuts),
                "tokens_cut_max": max(self.cuts, default=0),
                "tokens_cut_mean": sum(self.cuts) / len(self.cuts) if self.cuts else 0.0,
                "trained_tokens_cut": self.trained_tokens_cut}

    def describe(self) -> str:
        """One line for the log."""
        head = f"{self.rows} rows, longest {self.longest} tokens (data.max_length={self.max_length})"
        if not self.cuts:
            return f"{head}, none truncated"
        return (f"{head}: {len(self.cuts)} truncated ({self.mode}), tokens cut max {max(self.cuts)}, "
                f"mean {sum(self.cuts) / len(self.cuts):.1f}, trained tokens cut {self.trained_tokens_cut}")


@dataclass(frozen=True)
class SftSample:
    """One tokenized row. input_ids, loss_mask: (T,) int64; see the module docstring."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.numel())


def read_rows(files: str | Sequence[str], prompt_key: str = "prompt",
              response_key: str = "response") -> tuple[list[list[dict]], list[str]]:
    """Read (prompts, responses) from one or more parquet files; clear errors for missing/empty/bad files."""
    paths = [files] if isinstance(files, (str, Path)) else list(files)
    if not paths:
        raise ValueError("no parquet file given: set data.train_files / data.val_files")
    prompts: list[list[dict]] = []
    responses: list[str] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"SFT data file {path} does not exist: run stage 1 "
                                    "(python -m SPA_agent.generate_sft_data) or fix the data path")
        with pq.ParquetFile(path) as parquet:  # (pq.read_table's dataset API would import pandas: 0.8 s)
            _check_schema(parquet.schema_arrow, path, prompt_key, response_key)
            table = parquet.read(columns=[prompt_key, response_key])
        file_prompts, file_responses = table.column(prompt_key).to_pylist(), table.column(response_key).to_pylist()
        for row, (messages, response) in enumerate(zip(file_prompts, file_responses)):
            if response is None or messages is None or any(
                    m is None or m["role"] is None or m["content"] is None for m in messages):
                raise ValueError(f"{path} row {row} has a null {response_key!r} or {prompt_key!r} message: drop or "
                                 "fix that row (e.g. python sft/filter_sft_by_tag.py drops rows without a response)")
            prompts.append([{"role": m["role"], "content": m["content"]} for m in messages])
        responses.extend(file_responses)
    if not responses:
        raise ValueError(f"SFT data {', '.join(map(str, paths))} has no rows")
    return prompts, responses


def _check_schema(schema: pa.Schema, path: Path, prompt_key: str, response_key: str) -> None:
    expected = (f"columns {prompt_key!r}: list<struct<content: string, role: string>> and "
                f"{response_key!r}: string (spec §8)")
    names = schema.names
    if prompt_key not in names or response_key not in names:
        raise ValueError(f"{path} has columns {names}; expected {expected}")
    prompt_type, response_type = schema.field(prompt_key).type, schema.field(response_key).type
    ok_prompt = (pa.types.is_list(prompt_type) or pa.types.is_large_list(prompt_type)) and \
        pa.types.is_struct(prompt_type.value_type) and \
        {"content", "role"} <= {f.name for f in prompt_type.value_type}
    ok_response = pa.types.is_string(response_type) or pa.types.is_large_string(response_type)
    if not (ok_prompt and ok_response):
        raise ValueError(f"{path} has {prompt_key}: {prompt_type}, {response_key}: {response_type}; "
                         f"expected {expected}")


class SpaSftDataset(torch.utils.data.Dataset):
    """Tokenized SFT rows, held in memory (a stage-1 file is a few thousand rows).

    Args:
        files: parquet path(s) with the §8 schema.
        tokenizer: a fast tokenizer with a chat template; for `released` it must already hold the
            placeholder tokens (`sft.loss_targets.prepare_tokenizer`).
        max_length: the longest sequence (prompt + target) in tokens.
        truncation: `left` (the original's default, spec §4.6), `right` or `error` for longer rows.
        loss_target: which target tokens train (`sft.loss_targets.LossTarget`).
    """

    def __init__(self, files: str | Sequence[str], tokenizer, max_length: int = 2048,
                 truncation: str = "left", loss_target: str = "paper", prompt_key: str = "prompt",
                 response_key: str = "response"):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("SFT needs a fast tokenizer (offset mappings locate the trained spans)")
        if max_length < 2:
            raise ValueError(f"data.max_length must be at least 2, got {max_length}")
        self.loss_target = LossTarget.parse(loss_target)
        self.truncation = Truncation.parse(truncation)
        self.max_length = max_length
        self.files = [files] if isinstance(files, (str, Path)) else list(files)
        prompts, responses = read_rows(files, prompt_key, response_key)
        self.samples, self.truncation_report = self._tokenize(tokenizer, prompts, responses)

    def _tokenize(self, tokenizer, prompts: list[list[dict]],
                  responses: list[str]) -> tuple[list[SftSample], TruncationReport]:
        """All rows encoded at once (`sft.batch_encode`: the ids of `tokenizer(text, add_special_tokens=False)` for
        the prompt and the target text of each row), then masked and truncated row by row in numpy."""
        eot = end_of_turn_token(tokenizer)
        texts = [build_text(tokenizer, p, r, self.loss_target, eot) for p, r in zip(prompts, responses)]
        prompt_ids = encode_texts(tokenizer, [t.prompt_text for t in texts])
        targets = encode_with_offsets(tokenizer, [t.target_text for t in texts])
        special = placeholder_ids(tokenizer) if self.loss_target is LossTarget.RELEASED else None
        samples, cuts, trained_cut, longest = [], [], 0, 0
        for row, (text, prompt, (target, offsets)) in enumerate(zip(texts, prompt_ids, targets)):
            ids = np.concatenate([prompt, target])
            mask = np.concatenate([np.zeros_like(prompt), token_loss_mask(offsets, text.loss_spans)])
            if special is not None:
                mask = released_off_by_one(ids, mask, special)
            full_length, full_trained = len(ids), int(mask.sum())
            ids, mask = self._truncate(ids, mask, row)
            mask[0] = 0
            longest = max(longest, full_length)
            if len(ids) < full_length:
                cuts.append(full_length - len(ids))
                trained_cut += full_trained - int(mask.sum())
            samples.append(SftSample(torch.from_numpy(ids), torch.from_numpy(mask)))
        report = TruncationReport(len(samples), longest, self.max_length, self.truncation.value, tuple(cuts),
                                  trained_cut)
        return samples, report

    def _truncate(self, ids: np.ndarray, mask: np.ndarray, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Cut ids and mask with the same slice, so the mask stays aligned (spec §12.15)."""
        if len(ids) <= self.max_length:
            return ids, mask
        if self.truncation is Truncation.ERROR:
            raise ValueError(f"row {row} has {len(ids)} tokens > data.max_length={self.max_length}: raise "
                             "data.max_length or set data.truncation=left|right")
        cut = slice(-self.max_length, None) if self.truncation is Truncation.LEFT else slice(0, self.max_length)
        return ids[cut], mask[cut]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> SftSample:
        return self.samples[index]

    @property
    def lengths(self) -> list[int]:
        """Token count of every sample, in order."""
        return [len(s) for s in self.samples]

    def save(self, path: Path, key: dict) -> None:
        """The tokenized rows and their truncation report in one file, with `key` (what made them); the file
        appears whole or not at all."""
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        state = {"key": key, "lengths": lengths, "report": dataclasses.asdict(self.truncation_report),
                 "input_ids": torch.cat([s.input_ids for s in self.samples]).to(torch.int32),
                 "loss_mask": torch.cat([s.loss_mask for s in self.samples]).to(torch.int8)}
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        torch.save(state, partial)
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path, key: dict) -> SpaSftDataset | None:
        """The dataset `save` wrote to `path` with the same `key`; None if there is none."""
        if not path.is_file():
            return None
        state = torch.load(path, weights_only=True)
        if state["key"] != key:
            return None
        dataset = cls.__new__(cls)
        dataset.loss_target, dataset.truncation = LossTarget.parse(key["loss_target"]), Truncation(key["truncation"])
        dataset.max_length, dataset.files = key["max_length"], [f[0] for f in key["files"]]
        lengths = state["lengths"].tolist()
        dataset.samples = [SftSample(ids.long(), mask.long()) for ids, mask in
                           zip(state["input_ids"].split(lengths), state["loss_mask"].split(lengths))]
        report = state["report"]
        dataset.truncation_report = TruncationReport(**{**report, "cuts": tuple(report["cuts"])})
        return dataset


#: names a directory (sft/finetune_ft.sh makes a temporary one) through which the processes of one SFT run share the
#: tokenized data: the preflight tokenizes and writes it, every rank reads it instead of tokenizing again
TOKENIZED_DIR_ENV = "SPA_SFT_TOKENIZED"


def tokenized_dataset(name: str, files: str | Sequence[str], tokenizer, max_length: int = 2048,
                      truncation: str = "left", loss_target: str = "paper", prompt_key: str = "prompt",
                      response_key: str = "response") -> SpaSftDataset:
    """`SpaSftDataset(files, tokenizer, ...)`, shared as `<$SPA_SFT_TOKENIZED>/<name>.pt` where that is set: read
    from there when an earlier process of the run wrote it from the same files (path, size, modification time),
    tokenizer and settings, else tokenized and written there."""
    make = lambda: SpaSftDataset(files, tokenizer, max_length, truncation, loss_target, prompt_key, response_key)
    directory = os.environ.get(TOKENIZED_DIR_ENV)
    paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
    if not directory or not paths or not all(path.is_file() for path in paths):
        return make()  # (missing files are SpaSftDataset's error to report)
    key = {"files": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths],
           "tokenizer": str(tokenizer.name_or_path), "vocabulary": len(tokenizer), "max_length": max_length,
           "truncation": truncation, "loss_target": loss_target, "prompt_key": prompt_key,
           "response_key": response_key}
    path = Path(directory) / f"{name}.pt"
    dataset = SpaSftDataset.load(path, key)
    if dataset is None:
        dataset = make()
        dataset.save(path, key)
    return dataset

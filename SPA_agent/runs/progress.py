"""Progress bars that keep log files clean: tqdm on a terminal; off when the stream is redirected, where the
stages print one line per step or batch instead (no carriage returns or cursor-control sequences)."""

from __future__ import annotations

from tqdm.auto import tqdm


def progress_bar(iterable=None, disable: bool = False, **kwargs) -> tqdm:
    """`tqdm(iterable, **kwargs)`, shown only when its stream (stderr by default) is a terminal and not `disable`."""
    return tqdm(iterable, disable=True if disable else None, **kwargs)

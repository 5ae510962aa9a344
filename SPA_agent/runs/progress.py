"""Progress that keeps log files clean: tqdm bars on a terminal; plain lines when the stream is redirected
(no carriage returns or cursor-control sequences), so a log shows a stage is alive between its results."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

from tqdm.auto import tqdm

#: seconds between the plain lines of a long loop in a redirected log (the log shows a line at least every 30 s)
HEARTBEAT_S = 20.0


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether `stream` (stderr by default, where the bars go) is a terminal."""
    stream = stream if stream is not None else sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


def plain_line(text: str, stream: TextIO | None = None) -> None:
    """Print `text` to `stream` (stderr by default) only when it is redirected, where no bar shows progress."""
    stream = stream if stream is not None else sys.stderr
    if not is_terminal(stream):
        print(text, file=stream, flush=True)


class Heartbeat:
    """For loops without a natural step line (a long decode): `beat(describe)` prints `describe()` as a plain
    line when `interval_s` has passed since the start or the last line, and only when stderr is redirected."""

    def __init__(self, interval_s: float | None = None):
        self.interval_s = HEARTBEAT_S if interval_s is None else interval_s
        self.start = self.last = time.perf_counter()

    def beat(self, describe) -> None:
        now = time.perf_counter()
        if now - self.last >= self.interval_s:
            self.last = now
            plain_line(f"{describe()} ({now - self.start:.0f} s)")


def quiet_library_progress() -> None:
    """Entry points call this first: with stderr redirected, the progress bars of transformers (loading weights,
    writing shards) and huggingface_hub (downloads) are turned off, as they draw with carriage returns even into
    files."""
    if is_terminal():
        return
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging

    disable_progress_bars()
    logging.disable_progress_bar()


def progress_bar(iterable: Iterable | None = None, disable: bool = False, lines: bool = True, **kwargs):
    """`tqdm(iterable, **kwargs)` on a terminal. Redirected, an iterable instead yields its items and prints one
    plain line after each (`<desc> <i>/<total> done (<elapsed> s)`; `lines=False` for loops that print their own
    results); a bar without an iterable (updated by hand) prints nothing there. Nothing at all with `disable`."""
    stream = kwargs.get("file")
    if not disable and iterable is not None and not is_terminal(stream):
        return _plain_progress(iterable, kwargs.get("desc") or "progress", kwargs.get("total"),
                               kwargs.get("initial", 0), stream, lines)
    return tqdm(iterable, disable=True if disable else None, **kwargs)


def _plain_progress(iterable: Iterable, desc: str, total: int | None, initial: int, stream: TextIO | None,
                    lines: bool) -> Iterator:
    if total is None and hasattr(iterable, "__len__"):
        total = initial + len(iterable)
    start = time.perf_counter()
    for done, item in enumerate(iterable, start=initial + 1):
        yield item
        if lines:
            plain_line(f"{desc} {done}/{total if total is not None else '?'} done "
                       f"({time.perf_counter() - start:.0f} s)", stream)

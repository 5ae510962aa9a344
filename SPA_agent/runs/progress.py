"""Progress that keeps log files clean: tqdm bars on a terminal; plain lines when the stream is redirected
(no carriage returns or cursor-control sequences), so a log shows a stage is alive between its results."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
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


class BackgroundHeartbeat:
    """For work with no loop to beat in (one long training step, a validation pass, loading a model): between
    `start()` and `stop()` (or in a `with` block), a thread prints `<activity> (<seconds in it> s)` as a plain line
    whenever `interval_s` has passed since the start or the last line, only when stderr is redirected. The caller's
    own progress lines count: `mark()` after each. `doing(activity)` names what runs now."""

    def __init__(self, activity: str, interval_s: float | None = None, disable: bool = False):
        self.interval_s = HEARTBEAT_S if interval_s is None else interval_s
        self.disable = disable
        self.doing(activity)
        self.mark()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def doing(self, activity: str) -> None:
        self.activity, self.since = activity, time.perf_counter()

    def mark(self) -> None:
        self.last = time.perf_counter()

    def start(self) -> BackgroundHeartbeat:
        if not self.disable and self._thread is None and not is_terminal():
            self.mark()
            self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    __enter__ = start

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _beat(self) -> None:
        while not self._stopped.wait(max(0.0, self.last + self.interval_s - time.perf_counter())):
            now = time.perf_counter()
            if now - self.last >= self.interval_s:
                self.last = now
                plain_line(f"{self.activity} ({now - self.since:.0f} s)")


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


@contextmanager
def library_bars_off(*modules: ModuleType) -> Iterator[None]:
    """Inside: with stderr redirected, no bars from transformers (its own switch) nor from `modules` that call tqdm
    directly (their `tqdm` is swapped for a disabled one meanwhile), e.g. transformers' GGUF loader."""
    if is_terminal():
        yield
        return
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    bars = {module: module.tqdm for module in modules}
    for module, bar in bars.items():
        module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        for module, bar in bars.items():
            module.tqdm = bar
        if enabled:
            logging.enable_progress_bar()


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

"""Python's garbage collector in long training processes: what the objects built at start-up cost each step.

A full (generation 2) collection walks every object the process tracks. In the driver and in verl's Ray workers that
is millions of objects — the imports of torch, transformers, verl and vLLM, the models' modules — so one full
collection took 0.6-0.9 s in a verl worker on two H200s, and the driver spent about 0.6 s a step in them
(benchmarks/RESULTS.md, issue 28). While a worker collects, the other ranks wait in their next collective.

`freeze_long_lived_objects`, called once the models are built (`trainer.gc_freeze`), collects once and then moves
every object tracked so far into the permanent generation (`gc.freeze`), as vLLM does after its engine starts: later
collections walk only what was allocated since. What is frozen is never collected, so it is called once, after
start-up, not per step; the driver thaws its objects when training ends (`start_up_objects_frozen`), so that a
process that trains more than once (a notebook, the tests) can free the models of a finished run.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: with this environment variable "1", verl's workers freeze their start-up objects after building their models
#: (`verl_backend/patches.py`; the driver sets it for the Ray job when trainer.gc_freeze is on)
WORKER_GC_FREEZE_ENV = "SPA_GC_FREEZE"


def freeze_long_lived_objects() -> tuple[int, float]:
    """Collect the garbage there is, then exempt every object tracked now from later collections; returns how many
    objects are frozen in all and the seconds of that last collection over all of them (what each full collection
    would have cost from then on)."""
    start = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - start
    gc.freeze()
    return gc.get_freeze_count(), seconds


@contextmanager
def start_up_objects_frozen(enabled: bool) -> Iterator[None]:
    """With `enabled`, the objects alive on entry are exempt from collections until exit, then thawed (`gc.unfreeze`:
    back in the oldest generation, collected as usual again)."""
    if not enabled:
        yield
        return
    frozen, seconds = freeze_long_lived_objects()
    print(f"froze {frozen:,} start-up objects out of Python's garbage collections (trainer.gc_freeze): a full "
          f"collection over them took {seconds:.2f} s", flush=True)
    try:
        yield
    finally:
        gc.unfreeze()

"""`timing_s/gc_full`: the seconds of the driver's full garbage collections within a step (metrics.FullCollections)."""

from __future__ import annotations

import gc

from SPA_agent.trainer.metrics import FullCollections


def test_full_collections_are_timed_only_while_the_context_is_open():
    callbacks = list(gc.callbacks)
    with FullCollections() as collections:
        gc.collect(0)  # a young collection is not a full one
        assert collections.seconds == 0.0
        garbage = [[] for _ in range(10_000)]
        for a, b in zip(garbage, garbage[1:]):  # cycles a full collection has to walk
            a.append(b), b.append(a)
        del garbage
        gc.collect()
        once = collections.seconds
        assert once > 0.0
        gc.collect()
        assert collections.seconds > once  # each full collection adds its pause
    after = collections.seconds
    gc.collect()
    assert collections.seconds == after and gc.callbacks == callbacks  # closed: nothing more, callback gone

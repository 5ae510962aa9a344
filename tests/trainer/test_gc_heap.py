"""trainer.gc_freeze: start-up objects exempt from later garbage collections, in the driver and in verl's workers
(gc_heap, verl_patches.freeze_after_model_builds)."""

from __future__ import annotations

import gc
import statistics
import time
import weakref
from types import SimpleNamespace

import pytest

from SPA_agent.config import compose
from SPA_agent.trainer import gc_heap, main_ppo
from SPA_agent.trainer.verl_backend import backend as verl_backend
from SPA_agent.trainer.verl_backend import config as verl_config
from SPA_agent.trainer.verl_backend import patches as verl_patches


@pytest.fixture
def unfrozen():
    """Each test starts and ends with nothing frozen, so the rest of the suite collects as before."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _full_collection_seconds() -> float:
    return statistics.median(_timed(gc.collect) for _ in range(3))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_a_full_collection_no_longer_walks_what_start_up_left(unfrozen):
    long_lived = [{"layer": i, "weights": [i]} for i in range(200_000)]  # what imports and model building leave
    walking_all = _full_collection_seconds()
    frozen, seconds = gc_heap.freeze_long_lived_objects()
    assert seconds > 0 and frozen >= 2 * len(long_lived)  # each dict and its list, besides all that was alive before
    assert _full_collection_seconds() < walking_all / 4
    assert long_lived[-1]["weights"] == [199_999]  # frozen objects stay usable


def test_garbage_made_after_the_freeze_is_still_collected(unfrozen):
    gc_heap.freeze_long_lived_objects()

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only a collection frees
    alive = weakref.ref(a)
    del a, b
    gc.collect()
    assert alive() is None


def test_a_model_build_freezes_the_worker_after_it_returns_and_keeps_verls_dispatch(unfrozen, monkeypatch, capsys):
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers import engine_workers

    for class_name, name in verl_patches.MODEL_BUILDS.items():  # the methods exist and verl registered them
        method = getattr(getattr(engine_workers, class_name), name)
        assert hasattr(method, MAGIC_ATTR)
        monkeypatch.setattr(getattr(engine_workers, class_name), name, method)  # restored after the test
    verl_patches.freeze_after_model_builds()
    frozen_at_build = []

    def build(worker):
        frozen_at_build.append(gc.get_freeze_count())
        return "built"

    setattr(build, MAGIC_ATTR, {"dispatch_mode": "ONE_TO_ALL"})
    wrapped = verl_patches.frozen_after(build)
    assert getattr(wrapped, MAGIC_ATTR) == {"dispatch_mode": "ONE_TO_ALL"}
    assert wrapped(None) == "built" and frozen_at_build == [0] and gc.get_freeze_count() > 0
    assert "[spa gc] after " in capsys.readouterr().out
    for class_name, name in verl_patches.MODEL_BUILDS.items():
        method = getattr(getattr(engine_workers, class_name), name)
        assert method.__wrapped__ is not None and hasattr(method, MAGIC_ATTR)


@pytest.mark.parametrize("gc_freeze", [True, False])
def test_the_setting_reaches_every_ray_worker(gc_freeze):
    cfg = compose("_2_sokoban", ["model=tiny", "trainer.backend=verl", f"trainer.gc_freeze={gc_freeze}"])
    env = verl_backend.ray_runtime_env(verl_config.build_verl_config(cfg), True, cfg.trainer.gc_freeze, model_runner="auto", cpu_threads=1)
    assert env["env_vars"][gc_heap.WORKER_GC_FREEZE_ENV] == ("1" if gc_freeze else "0")


@pytest.mark.parametrize("gc_freeze", [True, False])
def test_the_driver_freezes_before_training_when_asked(unfrozen, monkeypatch, tmp_path, capsys, gc_freeze):
    frozen_at_fit = []
    trainer = SimpleNamespace(fit=lambda: frozen_at_fit.append(gc.get_freeze_count()), output_dir=tmp_path,
                              logger=SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(main_ppo, "build_trainer", lambda cfg, lock: trainer)
    cfg = compose("_2_sokoban", ["model=tiny", f"trainer.default_local_dir={tmp_path}", f"trainer.gc_freeze={gc_freeze}"])
    assert main_ppo.run(cfg) == tmp_path
    assert (frozen_at_fit[0] > 0) is gc_freeze
    assert ("start-up objects out of Python's garbage collections" in capsys.readouterr().out) is gc_freeze
    assert gc.get_freeze_count() == 0  # thawed after training: a later run in this process can free this one's models


def test_a_training_that_fails_still_thaws(unfrozen):
    with pytest.raises(RuntimeError), gc_heap.start_up_objects_frozen(True):
        assert gc.get_freeze_count() > 0
        raise RuntimeError("step failed")
    assert gc.get_freeze_count() == 0

"""The garbage collector in a serving process (`engine/gc_pauses.py`): its pauses are timed and
a long one is logged; the start-up heap is frozen out of later collections."""

from __future__ import annotations

import gc
import logging

from shoal.engine.gc_pauses import GcPauses, freeze_startup_heap


def make_cycles(count: int) -> None:
    for _ in range(count):
        node: dict = {}
        node["self"] = node  # only the cycle collector can free it


def test_pauses_are_counted_and_a_slow_one_is_logged(caplog):
    pauses = GcPauses(slow_seconds=0.0)  # every pause counts as slow here
    pauses.install()
    pauses.install()  # once only
    try:
        make_cycles(1000)
        with caplog.at_level(logging.WARNING, logger="shoal.engine.gc"):
            gc.collect()
    finally:
        pauses.uninstall()
    assert gc.callbacks.count(pauses._callback) == 0
    assert pauses.collections >= 1 and 0 < pauses.longest <= pauses.seconds  # (and automatic ones)
    full = [r.getMessage() for r in caplog.records if "generation 2 paused the process" in r.getMessage()]
    assert full, caplog.text  # the explicit full collection, with what it freed
    counted = pauses.collections
    gc.collect()  # uninstalled: no longer counted
    assert pauses.collections == counted


def test_the_start_up_heap_is_frozen_and_later_garbage_still_collected():
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 1000  # this test process's modules, at least
        make_cycles(10)
        assert gc.collect() >= 10  # made after the freeze: collected as before
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0

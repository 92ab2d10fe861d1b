"""`engine/stalls.py`: a duration far above its usual is logged, once the usual is known."""

from __future__ import annotations

import logging

from shoal.engine.stalls import StallWatch


def test_a_stall_is_logged_after_warm_up_and_a_lasting_slowdown_stops_being_one(caplog):
    watch = StallWatch("an engine step", factor=10.0, floor_seconds=0.1, smoothing=0.5, warmup=3)
    with caplog.at_level(logging.WARNING, logger="shoal.engine.stalls"):
        assert not watch.observe(5.0)  # the first calls compile: never a stall
        for _ in range(12):
            assert not watch.observe(0.01)
        assert not watch.observe(0.09)  # 9x: under the factor
        assert watch.observe(0.6, lambda: "64 rows, 0 prefill tokens")
        assert not watch.observe(0.05)  # above 10x the fast steps, but under the floor
        for _ in range(10):
            watch.observe(1.0)  # the new normal
        assert not watch.observe(1.0)
    assert watch.stalls == 1
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("an engine step took 600 ms, 12x its average of 50")
    assert message.endswith("ms (64 rows, 0 prefill tokens)")

"""Python's garbage collector in a serving process: freeze the start-up heap, time every pause.

A full collection walks every object the collector tracks, and a process that has imported
torch, compiled graphs and loaded a model holds hundreds of thousands of them. The collection
holds the GIL all that time, so every thread of the process stops with it: in the engine
process the GPU loop and the vocoder, and every listener hears the same gap. `freeze_startup_heap()`
moves what exists once a process is serving into the permanent generation, which collections
never walk (vLLM and sglang do the same after their warm-up); garbage made later is collected as
before. `GcPauses` times each collection through `gc.callbacks`, so a long pause is logged and
counted instead of guessed at.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

log = logging.getLogger("shoal.engine.gc")

SLOW_PAUSE_SECONDS = 0.05  # a collection this long is logged: a few engine steps stand still


def freeze_startup_heap() -> int:
    """Collect once, then keep everything alive now out of every later collection; returns how
    many objects were frozen. For a serving process once it is loaded (for the rest of its life:
    start-up objects that die later are freed by reference counting, only cycles among them stay)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("garbage collector: %d start-up objects frozen", frozen)
    return frozen


class GcPauses:
    """The collector's pauses in this process: their count, total and longest, from `install()`
    to `uninstall()`. The callback runs in whichever thread triggered the collection, while it
    holds the GIL, so the totals need no lock of their own."""

    def __init__(self, slow_seconds: float = SLOW_PAUSE_SECONDS) -> None:
        self.slow_seconds = slow_seconds
        self.collections = 0
        self.seconds = 0.0
        self.longest = 0.0
        self._started: float | None = None

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause = time.perf_counter() - self._started
        self._started = None
        self.collections += 1
        self.seconds += pause
        self.longest = max(self.longest, pause)
        if pause >= self.slow_seconds:
            log.warning(
                "garbage collection of generation %d paused the process for %.0f ms (%d objects freed)",
                info.get("generation", -1),
                1000 * pause,
                info.get("collected", 0),
            )

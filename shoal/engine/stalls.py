"""A line in the log when something that repeats (an engine step, a codec call) suddenly takes
far longer than it usually does: every stream waits through such a stall, and its cause (a
garbage collection, a compilation, a new graph shape) is easiest to find from when it happened."""

from __future__ import annotations

import logging
from collections.abc import Callable

from shoal.engine.admission import moving_average

log = logging.getLogger("shoal.engine.stalls")


class StallWatch:
    """Keeps a moving average of one repeated duration; logs a sample above both `factor` times
    that average and `floor_seconds` (before the average has `warmup` samples, nothing is logged:
    the first calls compile and capture). The sample still joins the average, so a lasting
    slowdown (a bigger batch) stops being reported once it is the norm."""

    def __init__(
        self,
        what: str,
        factor: float = 10.0,
        floor_seconds: float = 0.1,
        smoothing: float = 0.05,
        warmup: int = 20,
    ) -> None:
        self.what, self.factor, self.floor_seconds = what, factor, floor_seconds
        self.smoothing, self.warmup = smoothing, warmup
        self.average: float | None = None
        self.samples = 0
        self.stalls = 0

    def observe(self, seconds: float, detail: Callable[[], str] | None = None) -> bool:
        """Book one duration; True (and a warning, with `detail()` if given) when it is a stall.
        `detail` is called only then: the common case costs a comparison and an addition."""
        stalled = (
            self.average is not None
            and self.samples >= self.warmup
            and seconds > max(self.floor_seconds, self.factor * self.average)
        )
        if stalled:
            self.stalls += 1
            log.warning(
                "%s took %.0f ms, %.0fx its average of %.1f ms%s",
                self.what, 1000 * seconds, seconds / self.average, 1000 * self.average,
                f" ({detail()})" if detail else "",
            )  # fmt: skip
        self.average = moving_average(self.average, seconds, self.smoothing)
        self.samples += 1
        return stalled

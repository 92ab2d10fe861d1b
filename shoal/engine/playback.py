"""How far a stream's audio runs ahead of a listener: the quantity realtime admission protects.

The engine cannot see the client's player, so it assumes the strictest listener: one who starts
playing at the first audio and plays continuously. A stream's headroom is then the audio delivered
so far minus the wall time since its first audio. When a chunk arrives after the audio before it
has played out, that listener heard a gap: an underrun. The listener then resumes with the new
chunk, so the clock restarts from there (a gap is counted once, not again at every later chunk).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class PlaybackClock:
    """One stream's playback as the strictest listener hears it. Written by the vocoder thread
    (`deliver`), read by the engine thread (`headroom`); the lock keeps the pair consistent."""

    first_audio_at: float | None = None  # moved later by each gap (playback resumes after it)
    delivered_seconds: float = 0.0
    underruns: int = 0  # gaps heard so far
    stalled_seconds: float = 0.0  # total length of those gaps
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def deliver(self, seconds: float, now: float | None = None) -> float | None:
        """Book `seconds` of new audio handed to the client at `now`. Returns the gap the
        listener heard before it (seconds), or None when it arrived in time."""
        now = time.monotonic() if now is None else now
        gap = None
        with self._lock:
            if self.first_audio_at is None:
                self.first_audio_at = now
            else:
                ahead = self.first_audio_at + self.delivered_seconds - now
                if ahead < 0:
                    gap = -ahead
                    self.underruns += 1
                    self.stalled_seconds += gap
                    self.first_audio_at += gap  # the listener waited, then resumed
            self.delivered_seconds += seconds
        return gap

    @property
    def first_delivered_at(self) -> float | None:
        """When the first audio was handed over: `first_audio_at` before the gaps moved it."""
        with self._lock:
            return None if self.first_audio_at is None else self.first_audio_at - self.stalled_seconds

    def headroom(self, now: float | None = None) -> float | None:
        """Seconds of audio delivered but not yet played; None before the first audio."""
        with self._lock:
            if self.first_audio_at is None:
                return None
            now = time.monotonic() if now is None else now
            return self.first_audio_at + self.delivered_seconds - now

    def playing_for(self, now: float | None = None) -> float:
        """Seconds of playback since the first audio, gaps excluded (0 before it)."""
        with self._lock:
            if self.first_audio_at is None:
                return 0.0
            return (time.monotonic() if now is None else now) - self.first_audio_at

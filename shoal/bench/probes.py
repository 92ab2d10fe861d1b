"""Recorders for the in-process probes (`scripts/probe_first_audio.py`,
`scripts/probe_server_load.py`): wrappers around a live engine's methods that note when things
happen, leaving what they do unchanged."""

from __future__ import annotations

import time


def record_codec_calls(vocoder) -> list[tuple[float, float, int]]:
    """(start, end, streams) of every codec call the vocoder makes from now on."""
    calls: list[tuple[float, float, int]] = []
    decode = vocoder.decode

    def timed_decode(work):
        start = time.perf_counter()
        decode(work)
        calls.append((start, time.perf_counter(), len(work)))

    vocoder.decode = timed_decode
    return calls

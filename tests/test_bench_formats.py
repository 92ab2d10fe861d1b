"""`shoal bench formats`: real encoders in real processes, a measured rate for every row."""

from __future__ import annotations

import argparse
import re

import numpy as np

from shoal.bench import formats


def test_speech_like_audio_is_in_range_and_voiced():
    samples = formats.speech_like(1.0)
    assert samples.dtype == np.float32 and samples.size == formats.SAMPLE_RATE
    assert 0.2 < np.abs(samples).max() <= 0.35
    spectrum = np.abs(np.fft.rfft(samples))
    assert 80 < np.argmax(spectrum) * formats.SAMPLE_RATE / samples.size < 2000  # a voice's harmonics


def test_every_format_and_process_count_gets_a_measured_rate(capsys):
    parser = argparse.ArgumentParser()
    formats.add_arguments(parser)
    args = parser.parse_args(
        ["--formats", "wav", "mp3", "--processes", "1", "2", "--streams", "2", "--seconds", "0.5"]
    )
    assert formats.run(args) == 0
    rows = re.findall(r"^(\w+)\s+(\d+)\s+(\d+)\s+(\d+)$", capsys.readouterr().out, re.M)
    assert [(fmt, int(n)) for fmt, n, _, _ in rows] == [("wav", 1), ("wav", 2), ("mp3", 1), ("mp3", 2)]
    rates = {fmt: int(total) for fmt, n, total, _ in rows if n == "1"}
    assert rates["mp3"] > 1 and rates["wav"] > 10 * rates["mp3"]  # plain PCM costs next to nothing

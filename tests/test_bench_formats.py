"""`shoal bench formats`: real encoders in real processes, a measured rate for every row."""

from __future__ import annotations

import argparse
import re

from shoal.bench import formats


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

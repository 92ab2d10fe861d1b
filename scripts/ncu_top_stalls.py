"""Summarize Nsight Compute's SASS source page (`ncu --import R.ncu-rep --page source --csv
--print-source sass > R.csv`): the instructions with the most warp-stall samples, and the
executed instructions by opcode.

Stall samples say where warps wait (a load's consumer, a barrier, an MMA wait); for a short
single-program kernel (the sampler: a dozen samples per launch) the executed-instruction counts,
which are exact, say where the issue slots go instead.
Usage: python scripts/ncu_top_stalls.py R.csv [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re


def read_rows(path: str) -> list[dict[str, str]]:
    """The CSV's instruction rows (ncu prints a preamble before the header)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    start = text.find('"Address"')
    if start < 0:
        raise SystemExit(f"{path}: no SASS source table (was it exported with --print-source sass?)")
    return list(csv.DictReader(io.StringIO(text[start:])))


def number(text: str | None) -> float:
    try:
        return float((text or "0").replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """`@P0 LDG.E.64 R2, ...` -> `LDG`."""
    words = re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split()
    return words[0].split(".")[0] if words else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    rows = read_rows(args.csv)
    stalls = [(number(r.get("Warp Stall Sampling (All Samples)")), r["Address"], r["Source"]) for r in rows]
    total = sum(s for s, _, _ in stalls) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} stall samples")
    for samples, address, source in sorted(stalls, reverse=True)[: args.top]:
        print(f"{samples:7.0f} {100 * samples / total:5.1f}%  {address}  {source.strip()}")
    executed = collections.Counter()
    for r in rows:
        executed[opcode(r["Source"])] += number(r.get("Instructions Executed"))
    count = sum(executed.values())
    print(f"executed warp instructions: {count:.0f}")
    print("  " + ", ".join(f"{op} {n:.0f}" for op, n in executed.most_common(16)))


if __name__ == "__main__":
    main()

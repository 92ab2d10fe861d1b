"""`scripts/inspect_norm_sm90.py`: its count of dependent load rounds, on SASS lines and on real
sm_90 builds of the decode step's norm (compiled here, no GPU needed)."""

from __future__ import annotations

import re

import pytest
from script_testing import load_script, run_compiled


def test_a_round_ends_where_a_loaded_register_is_read() -> None:
    """Two loads, a use of the first (it waits: round one ends), one more load, its use; the loads
    before the PDL wait and after the first shuffle are not counted; a store's data register is a
    use, an address register of a later load is not."""
    script = load_script("inspect_norm_sm90")
    sass = [
        "@!P1 LDG.E R2, desc[UR10][R40.64] ;",
        "ACQBULK ;",
        "@!P0 LDG.E.128 R4, desc[UR10][R48.64] ;",
        "LDG.E.64 R8, desc[UR10][R50.64] ;",
        "IMAD.WIDE.U32 R52, R37, 0x2, R88 ;",
        "FADD R20, RZ, R9 ;",
        "@!P0 LDG.E.128 R12, desc[UR10][R52.64] ;",
        "STG.E desc[UR10][R60.64], R14 ;",
        "SHFL.BFLY PT, R5, R4, 0x8, 0x1f ;",
        "LDG.E R30, desc[UR10][R60.64] ;",
    ]
    assert script.load_rounds(sass) == [2, 1]
    assert script.load_rounds(sass[2:4]) == [2]  # no wait in the list: counted from the start


@pytest.mark.parametrize(
    "args",
    [
        ("--parts", "7", "--partials", "fp32", "--slice-groups", "4"),  # batch 1: o and down at M = 1
        ("--parts", "5", "--partials", "bf16", "--slice-groups", "8"),  # batch 16: down at M = 16
        ("--parts", "7", "--partials", "bf16", "--slice-groups", "32"),  # batch 64: down at M = 64
    ],
)
def test_decode_norms_load_in_one_round_with_the_register_limit(args: tuple[str, ...]) -> None:
    """The decode step's norm shapes, built as the step launches them (`NORM_MAX_REGISTERS`):
    every load of the partials, the residual and the slice is issued before the first use."""
    result = run_compiled("inspect_norm_sm90", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    report = result.stdout.strip().splitlines()[-1]
    assert re.search(r"register limit 255: \d+ registers, 1 round\(s\) of loads \[\d+\]$", report), report


def test_a_norm_gathering_its_rows_loads_the_ids_then_the_rows() -> None:
    """A fast pass's first norm gathering its code embeddings (`GatheredRows`): one round for the
    id, one for the whole row and the program's slice together, nothing after the first use."""
    result = run_compiled("inspect_norm_sm90", "--parts", "0", "--gather")
    assert result.returncode == 0, result.stderr[-3000:]
    report = result.stdout.strip().splitlines()[-1]
    assert report.startswith("norm gathering its rows"), report
    assert report.endswith("2 round(s) of loads [1, 2]"), report
    refused = run_compiled("inspect_norm_sm90", "--gather")
    assert refused.returncode != 0 and "--parts 0" in refused.stderr

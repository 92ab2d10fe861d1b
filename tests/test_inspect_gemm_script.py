"""`scripts/inspect_gemm_sm90.py`: the occupancy it reports from a build's registers and shared
memory, and a real sm_90 build read through `cuobjdump` (no GPU needed)."""

from __future__ import annotations

import re

from script_testing import load_script, run_compiled


def test_programs_per_sm() -> None:
    """Run 112's case: a 4-warp program at 128 registers fits four per SM, at 168 three; shared
    memory and the 64-warp limit bound it too."""
    script = load_script("inspect_gemm_sm90")
    assert script.programs_per_sm(128, 4, 39168) == 4
    assert script.programs_per_sm(168, 4, 39168) == 3
    assert script.programs_per_sm(79, 4, 65568) == 3  # the M = 64 GEMM: shared memory decides
    assert script.programs_per_sm(16, 4, 0) == 16  # warps decide


def test_store_widths() -> None:
    """Bytes per thread of each global store, read from SASS lines (predicated or not)."""
    script = load_script("inspect_gemm_sm90")
    sass = [
        "        /*0410*/  @P3 STG.E.128 desc[UR16][R2.64], R36 ;",
        "        /*0420*/  STG.E.128 desc[UR16][R12.64], R4 ;",
        "        /*0430*/  @!P0 STG.E.U16 desc[UR4][R2.64], R5 ;",
        "        /*0440*/  STG.E desc[UR4][R2.64], R5 ;",
        "        /*0450*/  STG.E.64 desc[UR4][R2.64], R6 ;",
        "        /*0460*/  STS.128 [R3+UR8], R20 ;",
    ]
    assert script.store_widths(sass) == {16: 2, 2: 1, 4: 1, 8: 1}


def test_reports_the_registers_of_an_sm90_build() -> None:
    """The script end to end on the M = 64 gate+up entry (compiled for sm_90 in a process without
    the interpreter, as the Gluon PTX tests do): its loop is pipelined, its stores are 16 bytes
    wide, and the registers and programs per SM come from the cubin."""
    result = run_compiled("inspect_gemm_sm90", "19456", "2560", "64")
    assert result.returncode == 0, result.stderr[-3000:]
    report = result.stdout.strip().splitlines()[-1]
    registers = int(re.search(r"(\d+) registers per thread", report).group(1))
    assert 32 <= registers <= 255 and "(pipelined)" in report
    assert re.search(r"global stores \d+ x 16 B;", report)  # the table's vector stores
    assert re.search(r"; [1-9]\d* programs per SM$", report)

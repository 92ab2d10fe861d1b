"""`scripts/inspect_attention_sm90.py`: the buffer count it reads from a build's TTGIR, its wave
arithmetic, and the real sm_90 builds of the tuned decode entries (compiled here, no GPU
needed), which must keep the occupancy their tables were measured with."""

from __future__ import annotations

import re

from script_testing import load_script, run_compiled


def test_key_buffers_read_from_the_allocations() -> None:
    """The largest leading dimension among [n, block_n, head_dim] allocations; other shapes
    (the query tile, the page numbers, per-key scales) do not count."""
    script = load_script("inspect_attention_sm90")
    ttgir = "\n".join(
        [
            "%0 = ttg.local_alloc %q : () -> !ttg.memdesc<16x128xbf16, #shared, #smem>",
            "%1 = ttg.local_alloc : () -> !ttg.memdesc<1x64xi32, #shared1, #smem, mutable>",
            "%2 = ttg.local_alloc : () -> !ttg.memdesc<2x64x128xbf16, #shared2, #smem, mutable>",
            "%3 = ttg.local_alloc : () -> !ttg.memdesc<2x64x128xbf16, #shared2, #smem, mutable>",
            "%4 = ttg.local_alloc : () -> !ttg.memdesc<3x32x128xbf16, #shared2, #smem, mutable>",
        ]
    )
    assert script.key_buffers(ttgir, 64) == 2
    assert script.key_buffers(ttgir, 32) == 3
    assert script.key_buffers(ttgir, 128) == 0


def test_waves() -> None:
    """Programs = batch x 8 kv heads x splits over 132 SMs x programs per SM."""
    script = load_script("inspect_attention_sm90")
    build = script.EntryBuild("bf16", 16, 3, 32, 3, 2, 158, 37888, 3)
    assert build.programs == 384 and build.waves == 1
    assert script.EntryBuild("fp8", 16, 3, 128, 2, 1, 181, 41984, 2).waves == 2


def test_tuned_entries_keep_their_occupancy_in_serving_tables() -> None:
    """In `shoal serve`'s 32k-key tables every bf16 entry runs its largest batch in one wave, the
    3-stage entries with two key/value buffers (the page numbers loaded a block ahead), and the
    e4m3 cache's batch-16 entry holds 168 registers (more without its cap: two waves)."""
    result = run_compiled("inspect_attention_sm90", "--capacity", "32768")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    bf16 = [line for line in lines if line.startswith("bf16 ")]
    assert len(bf16) == 5, result.stdout
    for line in bf16:
        assert line.endswith(": 1 wave(s)"), line
        if " 3 stages:" in line:
            assert " 2 key/value buffer(s)," in line, line
    (fp8_16,) = [line for line in lines if line.startswith("fp8 batch 16:")]
    assert re.search(r" 168 registers, .* 1 wave\(s\)$", fp8_16), fp8_16

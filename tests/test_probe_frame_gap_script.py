"""`scripts/probe_frame_gap.py`: splitting a decode timeline into steps at its copies and pauses,
and the per-step medians it reports (on a synthetic trace; the script itself needs a GPU)."""

from __future__ import annotations

from script_testing import load_script

IN, OUT = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"


def _timeline(steps: int, kernels: int, idle_after: float) -> list[tuple[str, str, float, float]]:
    """Each step: a 2 µs copy in, `kernels` 1.2 µs kernels starting 1 µs apart (PDL overlap),
    a 1.5 µs copy out, then `idle_after` µs before the next copy in."""
    events, t = [], 0.0
    for _ in range(steps):
        events.append(("gpu_memcpy", IN, t, 2.0))
        t += 4.0
        for _ in range(kernels):
            events.append(("kernel", "k", t, 1.2))
            t += 1.0
        t += 0.5
        events.append(("gpu_memcpy", OUT, t, 1.5))
        t += 1.5 + idle_after
    return events


def test_steady_steps_split_at_the_copies() -> None:
    script = load_script("probe_frame_gap")
    table = script.frame_table(_timeline(12, 200, 3.0))
    assert table["kernels"] == 200 and table["copies"] == 2
    assert table["h2d"] == 2.0 and table["d2h"] == 1.5
    # span: first kernel start to last kernel end; idle: last kernel end to the next first start
    assert abs(table["span"] - 200.2) < 1e-6
    assert abs(table["idle"] - (0.3 + 1.5 + 3.0 + 4.0)) < 1e-6
    assert abs(table["interval"] - (table["span"] + table["idle"])) < 1e-6


def test_small_launches_are_not_decode_steps() -> None:
    """A prefill's or first frame's short runs of kernels (<= 100) are left out of the medians."""
    script = load_script("probe_frame_gap")
    events = _timeline(3, 40, 20.0) + [(c, n, s + 10_000.0, d) for c, n, s, d in _timeline(10, 150, 5.0)]
    table = script.frame_table(events)
    assert table["kernels"] == 150


def test_steps_without_copies_split_at_their_first_kernel() -> None:
    """`advance_on_device`: no copies and a short pause between graphs; the step's first kernel
    (the token embedding) marks each step."""
    script = load_script("probe_frame_gap")
    events, t = [], 0.0
    for _ in range(12):
        for i in range(200):
            events.append(("kernel", "_embed_tokens_kernel_0d1d" if i == 0 else "k", t, 1.2))
            t += 1.0
        t += 3.0  # 2.8 µs from the last kernel's end (1.2 µs long) to the next step's first start
    table = script.frame_table(events)
    assert table["kernels"] == 200 and table["copies"] == 0
    assert abs(table["idle"] - 2.8) < 1e-6 and abs(table["interval"] - 203.0) < 1e-6

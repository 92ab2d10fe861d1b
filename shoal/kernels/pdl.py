"""Programmatic dependent launch (PDL): let the next kernel of the decode step start early.

The decode step is about a thousand small kernels per frame at batch 1, replayed as a CUDA graph;
between two kernels the GPU drains the first and only then schedules the second's blocks, a fixed
gap of a few microseconds each time: most of the distance to the floor at batch 1.
On Hopper a kernel launched with the PDL attribute (`launch_pdl=True`; graph capture keeps it as a
programmatic edge) may be scheduled while its predecessor is still running. The contract:

- every kernel so launched calls `wait_for_inputs` before it reads anything the kernel before it
  writes (griddepcontrol.wait: blocks until the predecessor has finished and its writes are
  visible); reads of weights and other constants of the step (docs/engine.md lists them: also
  the step's metadata, uploaded by the host or advanced by the previous step's last kernel,
  `kernels/window.py`) may come before it, and so may reads, at L2, of what a kernel
  at least two launches back wrote (by the next rule it has finished when this kernel starts);
- `wait_for_inputs` then lets the kernel after it launch (griddepcontrol.launch_dependents).
  Triggering after the wait, never before, keeps at most one kernel waiting behind a running one.

Kernels compiled with `USE_PDL=False` (CPU interpreter, pre-Hopper GPUs, `Tuning.pdl` off) are the
plain kernels. A kernel compiled with `USE_PDL=True` but launched without the attribute waits on
nothing: the instructions are no-ops then, so correctness never depends on how it was launched.
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

from shoal.tuning import TUNING


@functools.cache
def _enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not TUNING.pdl:
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def pdl_launch(family: str | None = None) -> dict:
    """Launch keywords for a kernel that takes `USE_PDL`: `kernel[grid](..., **pdl_launch())`.
    `family` (e.g. "attention") in `Tuning.pdl_skip` launches those kernels plainly,
    for same-run A/B measurements of where PDL pays."""
    if not _enabled() or (family is not None and family in TUNING.pdl_skip):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Block until the previous kernel's writes are visible, then let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

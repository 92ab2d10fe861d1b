"""Part of the fast transformer's weights kept in L2 across a decode step (an access-policy window).

Why: a frame runs the fast transformer once per codebook after the first (9 passes for S2-Pro),
each pass over the same layers: about 400 MB of FP8 weights per pass, so nothing of them
survives in the H200's 50 MB L2 until the next pass, and every pass streams them from HBM again.
An access-policy window marks the lines of one fast weight as *persisting*: they stay in a
set-aside part of L2 (`cuCtxSetLimit`) that the streaming reads of every other weight do not
evict, so every pass after the first reads that part from L2. At batch 1 that removes
(passes - 1) x set-aside bytes of HBM reads per step, about 8 x 37 MB of the 7.3 GB an S2-Pro
frame reads.

The window is a kernel-node attribute of the captured CUDA graphs (`L2Window.apply`): a graph is
captured with `keep_graph=True`, the attribute set on each kernel node, then instantiated. A
kernel touching no address in the window is unaffected. Its hit ratio is min(1, set-aside /
window bytes), CUDA's rule against persisting lines evicting each other.

Through the CUDA driver API (libcuda, which torch's CUDA context has loaded): no dependency.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_ATTRIBUTE_MAX_PERSISTING_L2 = 108
_ATTRIBUTE_MAX_WINDOW = 109
_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
_NODE_TYPE_KERNEL = 0
_ACCESS_STREAMING, _ACCESS_PERSISTING = 1, 2


class _AccessPolicyWindow(ctypes.Structure):
    _fields_ = [
        ("base_ptr", ctypes.c_void_p),
        ("num_bytes", ctypes.c_size_t),
        ("hit_ratio", ctypes.c_float),
        ("hit_prop", ctypes.c_int),
        ("miss_prop", ctypes.c_int),
    ]


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("window", _AccessPolicyWindow), ("pad", ctypes.c_char * 64)]


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {result}")


def _device_attribute(attribute: int, device: torch.device) -> int:
    handle, value = ctypes.c_int(), ctypes.c_int()
    _check(_driver().cuDeviceGet(ctypes.byref(handle), device.index or 0), "cuDeviceGet")
    _check(_driver().cuDeviceGetAttribute(ctypes.byref(value), attribute, handle), "cuDeviceGetAttribute")
    return value.value


@dataclass(frozen=True)
class L2Window:
    """A persisting window over [base_ptr, base_ptr + num_bytes) with its set-aside bytes."""

    base_ptr: int
    num_bytes: int
    set_aside: int

    @property
    def hit_ratio(self) -> float:
        return min(1.0, self.set_aside / self.num_bytes)

    def apply(self, graph: torch.cuda.CUDAGraph) -> int:
        """Set the window on every kernel node of `graph` (captured with keep_graph=True, not yet
        instantiated); returns how many nodes took it."""
        raw = ctypes.c_void_p(graph.raw_cuda_graph())
        count = ctypes.c_size_t()
        _check(_driver().cuGraphGetNodes(raw, None, ctypes.byref(count)), "cuGraphGetNodes")
        nodes = (ctypes.c_void_p * count.value)()
        _check(_driver().cuGraphGetNodes(raw, nodes, ctypes.byref(count)), "cuGraphGetNodes")
        value = _LaunchAttributeValue()
        value.window = _AccessPolicyWindow(
            self.base_ptr, self.num_bytes, self.hit_ratio, _ACCESS_PERSISTING, _ACCESS_STREAMING
        )
        kind, applied = ctypes.c_int(), 0
        for node in map(ctypes.c_void_p, nodes):
            _check(_driver().cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
            if kind.value == _NODE_TYPE_KERNEL:
                attribute = _LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW
                call = _driver().cuGraphKernelNodeSetAttribute(node, attribute, ctypes.byref(value))
                _check(call, "cuGraphKernelNodeSetAttribute")
                applied += 1
        return applied


def reserve_window(weight: torch.Tensor) -> L2Window | None:
    """Set aside as much L2 for persisting lines as the device allows (up to the weight's bytes)
    and return a window over `weight`; None off CUDA or where the device has no set-aside."""
    if weight.device.type != "cuda" or not weight.is_contiguous():
        return None
    max_set_aside = _device_attribute(_ATTRIBUTE_MAX_PERSISTING_L2, weight.device)
    max_window = _device_attribute(_ATTRIBUTE_MAX_WINDOW, weight.device)
    num_bytes = min(weight.numel() * weight.element_size(), max_window)
    set_aside = min(max_set_aside, num_bytes)
    if set_aside <= 0:
        return None
    limit = _driver().cuCtxSetLimit(_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(set_aside))
    _check(limit, "cuCtxSetLimit")
    return L2Window(weight.data_ptr(), num_bytes, set_aside)


def reset_persisting() -> None:
    """Demote every persisting line to normal (before timing a graph captured without the window,
    so that lines an earlier replay left persisting do not hold the set-aside)."""
    _check(_driver().cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")


def largest_fast_weight(step) -> torch.Tensor | None:
    """The largest weight a fast pass reads (`DecodeStep`): with FP8, the fast blocks' e4m3
    matrices (gate|up concatenated where it is one GEMM), else the fast layers' parameters."""
    model = step.model
    if step.fp8 is not None:
        tensors = []
        for layer in model.fast_layers:
            block = step.fp8.blocks[id(layer)]
            halves = [block.gate_up] if block.gate_up is not None else [block.w1, block.w3]
            tensors += [w.q for w in (block.qkv, block.wo, *halves, block.w2)]
    else:
        tensors = [p for layer in model.fast_layers for p in layer.parameters()]
    return max(tensors, key=lambda t: t.numel() * t.element_size(), default=None)


__all__ = ["L2Window", "largest_fast_weight", "reserve_window", "reset_persisting"]

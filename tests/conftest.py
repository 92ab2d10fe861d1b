"""Shared test setup: the golden data in tests/golden, and small helpers."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).resolve().parent / "golden"

# One thread: on a small shared CI box, multi-threaded tiny ops spend most of their time waiting
# for the second thread to be scheduled (measured: ~15 ms per op), far slower than one thread.
torch.set_num_threads(1)

# Without a GPU, Triton kernels run in the interpreter; set it before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seeded_random(request: pytest.FixtureRequest) -> None:
    """Each test starts from its own fixed seed (from its id), so a test drawing unseeded random
    weights or inputs sees the same numbers in every run: a tolerance check either always holds
    or always fails (an unseeded layout test once failed CI by chance)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN


def _allow_scalar_loop_bounds_in_interpreter() -> None:
    """Triton 3.6's interpreter turns scalars into 1-element arrays and `int()`s them for
    `range(lo, hi)`; NumPy >= 2.4 refuses that. Index through the single element instead.
    Idempotent; only ever applied when TRITON_INTERPRET=1."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_shoal_scalar_index", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._shoal_scalar_index = True
    interpreter._patch_lang_tensor = patched


class _NoPatches:
    def restore(self) -> None:
        pass


def _patch_language_once_per_launch() -> None:
    """Triton 3.6's interpreter re-patches `triton.language` (an `inspect.getmembers` walk over
    every module) at each call of a `@triton.jit` helper inside a kernel, although the launch
    has patched the same modules already: 40% of an interpreted engine step. Within a launch,
    a helper whose language modules are patched skips it; the launch restores them as before.
    Idempotent; only ever applied when TRITON_INTERPRET=1."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "_shoal_once_per_launch", False):
        return
    active: dict = {"scope": None, "langs": set()}

    def languages(fn) -> set[int]:
        values = fn.__globals__.values()
        return {id(v) for v in values if inspect.ismodule(v) and v in (tl, tl.core)}

    def patched(fn):
        langs = languages(fn)
        if active["scope"] is not None and langs <= active["langs"]:
            return _NoPatches()  # a helper called inside a launch that patched these modules
        scope = original(fn)
        if active["scope"] is None:  # a launch: it restores its scope when its grid has run
            active.update(scope=scope, langs=langs)
            restore = scope.restore

            def restore_and_forget() -> None:
                restore()
                active.update(scope=None, langs=set())

            scope.restore = restore_and_forget
        else:
            active["langs"] |= langs
        return scope

    patched._shoal_once_per_launch = True
    interpreter._patch_lang = patched


def _patch_interpreter_if_interpreting() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        _allow_scalar_loop_bounds_in_interpreter()
        _patch_language_once_per_launch()


# Kernel test modules set TRITON_INTERPRET=1 themselves (on a machine without CUDA) when pytest
# imports them, i.e. after this file: patch now if it is already set, and again once collection
# has imported every module (before any kernel runs).
_patch_interpreter_if_interpreting()


def pytest_collection_finish(session: pytest.Session) -> None:
    _patch_interpreter_if_interpreting()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`interpreter` tests hand CPU tensors to Triton kernels: on a machine with CUDA the kernels
    are compiled for the GPU and cannot read them, so these tests are skipped there."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="Triton kernels on CPU tensors: only in the interpreter (no CUDA)")
    for item in items:
        if "interpreter" in item.keywords:
            item.add_marker(skip)

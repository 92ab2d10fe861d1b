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


# Over about 10 s each on CI's 2-core CPU, and what they check runs on the GPU in `gpu` tests:
# engine runs of GPU-only paths in the Triton interpreter (test_engine_gpu.py runs those paths for
# real), and kernels at their larger test shapes (a smaller shape of the same test stays in the
# default run). Marked `cpu_heavy`: `bash scripts/test.sh` leaves them out, `--all` runs them.
CPU_HEAVY = {
    "tests/test_engine_decode_step.py::test_kernel_step_equals_torch_step[head-kernel]",
    "tests/test_inspect_norm_script.py::test_decode_norms_load_in_one_round_with_the_register_limit[args1]",
    "tests/test_inspect_norm_script.py::test_decode_norms_load_in_one_round_with_the_register_limit[args2]",
    "tests/test_sample_kernel.py::test_chunked_draws_equal_one_program_per_row"
    "[codebook-256-16-8-bf16-ties-chunks4]",
    "tests/test_sample_kernel.py::test_radix_draws_equal_the_reference_on_random_rows[64-300-True]",
    "tests/test_sample_kernel.py::test_radix_draws_equal_the_reference_on_random_rows[64-1000-False]",
    "tests/test_sample_kernel.py::test_radix_select_returns_the_keys_topk_returns[bf16-ties-2]",
    "tests/test_sample_kernel.py::test_radix_select_returns_the_keys_topk_returns[random-2]",
    "tests/test_sample_kernel.py::test_radix_select_returns_the_keys_topk_returns[outliers-last-64]",
    "tests/test_sample_kernel.py::test_row_one_past_a_power_of_two_splits_off_its_last_column[random]",
    "tests/test_sample_kernel.py::test_row_one_past_a_power_of_two_splits_off_its_last_column[mostly-inf]",
    "tests/test_sample_kernel.py::test_the_benchmarks_sampler_inputs_draw_like_the_reference[codebook]",
    "tests/test_fast_attention_kernel.py::test_split_k_partials_give_the_reduced_qkvs_bits[norm-bf16-partials]",
    "tests/test_engine_fp8.py::test_triton_projections_equal_reference[planted-w8a8_inline]",
    "tests/test_codec_stream.py::test_compiled_transformer_step_equals_the_full_decode",
    "tests/test_engine_advance_on_device.py::test_steady_steps_upload_nothing_and_give_the_same_frames",
    "tests/test_engine_prefill_batch.py::test_engine_with_static_prefill_equals_without[1]",
    "tests/test_engine_prefill_batch.py::test_engine_with_static_prefill_equals_without[3]",
    "tests/test_engine_prefill_batch.py::test_packed_chunks_equal_the_eager_varlen_prefill",
    "tests/test_engine_first_frame.py::test_static_first_frames_equal_eager_frames[kernels]",
    "tests/test_engine_fp8.py::test_consumers_summing_split_k_partials_equal_the_reducing_gemms[row-programs]",
    "tests/test_engine_fp8.py::test_consumers_summing_split_k_partials_equal_the_reducing_gemms"
    "[split-rows-unfused-fast]",
    "tests/test_engine_fp8.py::test_fused_input_quantization_equals_separate_launches[split-rows]",
    "tests/test_engine_fp8.py::test_fused_input_quantization_equals_separate_launches[wide]",
    "tests/test_engine_decode_step.py::test_kernel_step_equals_torch_step[capped]",
    "tests/test_engine_decode_step.py::test_kernel_step_equals_torch_step[full]",
    "tests/test_engine_decode_step.py::test_kernel_step_with_wide_rows_equals_torch_step[4]",
    "tests/test_sample_kernel.py::test_radix_select_returns_the_keys_topk_returns[s2-whole-64]",
    "tests/test_sample_kernel.py::test_radix_select_returns_the_keys_topk_returns[s2-whole-2]",
    "tests/test_sample_kernel.py::test_radix_select_returns_the_keys_topk_returns[bf16-ties-64]",
    "tests/test_sample_kernel.py::test_radix_select_returns_the_keys_topk_returns[random-64]",
    "tests/test_sample_kernel.py::test_radix_select_returns_the_keys_topk_returns[neg-inf-64]",
    "tests/test_sample_kernel.py::test_radix_select_returns_the_keys_topk_returns[signed-zeros-64]",
    "tests/test_sample_kernel.py::test_radix_select_returns_the_keys_topk_returns[ties-shuffled-ids-64]",
    "tests/test_sample_kernel.py::test_chunked_draws_equal_one_program_per_row[codebook-4096-1-64-fp32-chunks0]",
    "tests/test_sample_kernel.py::test_chunked_draws_equal_one_program_per_row[codebook-4096-1-32-bf16-chunks1]",
    "tests/test_sample_kernel.py::test_chunked_draws_equal_one_program_per_row"
    "[codebook-4096-1-8-bf16-ties-chunks2]",
    "tests/test_sample_kernel.py::test_chunked_draws_equal_one_program_per_row[main-4097-3-8-fp32-chunks6]",
    "tests/test_sample_kernel.py::test_chunked_draws_equal_one_program_per_row"
    "[main-4097-1-64-bf16-ties-chunks5]",
    "tests/test_sample_kernel.py::test_chunked_draws_equal_one_program_per_row[main-257-16-16-fp32-chunks7]",
    "tests/test_step_inputs_kernel.py::test_sum_order_is_sequential_and_torch_within_one_ulp[dtype1]",
    "tests/test_fast_attention_kernel.py::test_frame_matches_two_kernel_path[g3-norm]",
    "tests/test_fast_attention_kernel.py::test_frame_matches_two_kernel_path[g4-norm]",
    "tests/test_fast_attention_kernel.py::test_frame_matches_two_kernel_path[g4]",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the `CPU_HEAVY` tests (tests/test_cpu_heavy_list.py checks that each still exists).
    `interpreter` tests hand CPU tensors to Triton kernels: on a machine with CUDA the kernels
    are compiled for the GPU and cannot read them, so these tests are skipped there."""
    heavy = pytest.mark.cpu_heavy
    for item in items:
        if item.nodeid in CPU_HEAVY:
            item.add_marker(heavy)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="Triton kernels on CPU tensors: only in the interpreter (no CUDA)")
    for item in items:
        if "interpreter" in item.keywords:
            item.add_marker(skip)

"""The Gluon FP8 GEMM (`kernels/fp8_gemm_gluon.py`, `GemmConfig.gluon`): where its weight copies
sit against the PDL wait (`tiles_before_wait`), and its bits against the Triton kernel's equivalent config
(swapped tiles, TMA, scales one step ahead), which is also what runs in its place on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from fp8_testing import DEVICE, S2_SHAPES, fp8_weight, rel_err  # noqa: E402

from shoal.kernels import fp8_gemm as gemm  # noqa: E402
from shoal.kernels import quant  # noqa: E402
from shoal.kernels import reference as ref  # noqa: E402

_PTX_PROBE = """
import json, sys
from shoal.kernels.fp8_gemm_gluon import compile_for_hopper
report = []
for m, n, k, split, stages, ahead, pdl, swapped in json.loads(sys.argv[1]):
    tile = dict(block_m=16, block_n=64) if swapped else dict(block_m=64, block_n=32)
    ptx = compile_for_hopper(m, n, k, **tile, split_k=split, num_stages=stages, swapped=swapped,
                             tiles_before_wait=ahead, leave_partials=True, use_pdl=pdl).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    head = ptx[:wait] if wait >= 0 else ""
    release = ptx.find("griddepcontrol.launch_dependents")
    copies = "cp.async.bulk.tensor"
    report.append({"wait": wait >= 0, "release_after_wait": release > wait,
                   "copies_before": head.count(copies), "copies": ptx.count(copies)})
print(json.dumps(report))
"""


def test_weight_copies_come_before_the_pdl_wait() -> None:
    """The sm_90 build (compiled here, no GPU needed): each program issues its first
    min(tiles_before_wait, steps) weight copies, and only those, before griddepcontrol.wait; the
    rest of the ring and the activation copies come after it. Without PDL there is no wait. The
    same with unswapped tiles (64 activation rows on the wgmma's M side, 32 weight columns)."""
    cases = [
        (1, 2560, 9728, 7, 4, 4, True, True),  # down at M = 1: 11 steps per split, the whole ring ahead
        (1, 2560, 9728, 14, 6, 6, True, True),  # 6 steps, 6 stages: the whole split's weights ahead
        (1, 6144, 2560, 6, 6, 6, True, True),  # qkv: 4 steps per split, fewer than the stages
        (1, 2560, 9728, 7, 4, 1, True, True),  # one tile ahead, three after the wait
        (1, 2560, 9728, 7, 4, 4, False, True),
        (64, 2560, 9728, 7, 4, 2, True, False),  # down at M = 64, unswapped, two tiles ahead
    ]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _PTX_PROBE, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    down, whole, qkv, one, plain, unswapped = json.loads(result.stdout.strip().splitlines()[-1])
    assert down == {"wait": True, "release_after_wait": True, "copies_before": 4, "copies": 10}
    assert whole["copies_before"] == 6 and qkv["copies_before"] == 4
    assert one["copies_before"] == 1 and one["copies"] == down["copies"]
    assert not plain["wait"]
    assert unswapped == {"wait": True, "release_after_wait": True, "copies_before": 2, "copies": 10}


def _equivalent(config: gemm.GemmConfig) -> gemm.GemmConfig:
    return replace(config, gluon=False, tma=True, scales_ahead=True, tma_scales=False, vector_stores=False)


def test_scale_copies_read_the_group_major_buffer_as_a_flat_vector() -> None:
    """`tma_scales` reads group kb of row r at kb * M + r of the flat buffer; a buffer laid out
    otherwise, not 16-byte aligned, with M not a multiple of 4 (a copy must start on 16 bytes) or
    shorter than one copy, is refused (its launch loads the scales by pointer)."""
    from shoal.kernels.fp8_gemm_gluon import flat_scales

    scales = quant.new_activation_scales(8, 512, "cpu")
    scales.copy_(torch.arange(32, dtype=torch.float32).view(8, 4))
    flat = flat_scales(scales, 16)
    assert flat is not None and flat.data_ptr() == scales.data_ptr()
    assert all(flat[kb * 8 + r] == scales[r, kb] for r in range(8) for kb in range(4))
    assert flat_scales(quant.new_activation_scales(16, 2560, "cpu"), 16) is not None
    for m in (1, 5, 9):  # copies would start off 16 bytes
        assert flat_scales(quant.new_activation_scales(m, 4096, "cpu"), 16) is None
    assert flat_scales(quant.new_activation_scales(4, 512, "cpu"), 16) is None  # 16 < one copy
    assert flat_scales(torch.zeros(8, 4), 16) is None  # row-major
    assert flat_scales(quant.new_activation_scales(9, 512, "cpu")[1:], 16) is None  # strides (1, 9)
    offset = torch.zeros(4 * 8 + 1)[1:].view(4, 8).t()  # group-major, 4 bytes past alignment
    assert flat_scales(offset, 16) is None


def _sm90_probe(code: str) -> list[str]:
    """The output lines of `code` run in a fresh interpreter without TRITON_INTERPRET, where
    `compile_for_hopper` builds the real sm_90 kernel (no GPU needed)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()


def test_scale_copies_ride_the_ring() -> None:
    """The sm_90 build with `tma_scales` (compiled here): one 1-D bulk copy per stage for the
    scales beside the two tile copies, and no activation-scale pointer load left in the loop."""
    probe = (
        "from shoal.kernels.fp8_gemm_gluon import compile_for_hopper\n"
        "for flag in (False, True):\n"
        "    ptx = compile_for_hopper(64, 2560, 4096, block_m=64, block_n=32, split_k=4, num_stages=4,\n"
        "        swapped=False, tiles_before_wait=1, leave_partials=True, tma_scales=flag).asm['ptx']\n"
        "    print(ptx.count('cp.async.bulk.tensor.1d'), ptx.count('cp.async.bulk.tensor.2d'),\n"
        "          ptx.count('ld.global'))\n"
    )
    (plain_1d, plain_2d, plain_loads), (ring_1d, ring_2d, ring_loads) = (
        tuple(int(x) for x in line.split()) for line in _sm90_probe(probe)[-2:]
    )
    assert plain_1d == 0 and ring_2d == plain_2d
    assert ring_1d == ring_2d // 2  # one scale copy per activation tile copy
    assert ring_loads < plain_loads  # the activation scales' pointer loads are gone


def test_vector_stores_write_sixteen_bytes_per_instruction() -> None:
    """The sm_90 build with `vector_stores` (compiled here, with the launcher's 16-divisibility
    specialization): the tile's global stores are all 16 bytes wide, where the accumulator's
    layout stores 2 (bf16, swapped) or 4 bytes (bf16 pairs, unswapped) per instruction."""
    probe = (
        "import re\n"
        "from shoal.kernels.fp8_gemm_gluon import compile_for_hopper\n"
        "for m, n, k, bm, bn, swapped in ((16, 2560, 9728, 16, 64, True), (64, 2560, 9728, 64, 32, False)):\n"
        "    for flag in (False, True):\n"
        "        ptx = compile_for_hopper(m, n, k, block_m=bm, block_n=bn, split_k=7, num_stages=4,\n"
        "            swapped=swapped, tiles_before_wait=1, leave_partials=True, bf16_partials=True,\n"
        "            vector_stores=flag).asm['ptx']\n"
        "        print(' '.join(sorted(set(re.findall(r'st\\.global(?:\\.\\w+)*', ptx)))))\n"
    )
    swapped, swapped_vector, unswapped, unswapped_vector = _sm90_probe(probe)[-4:]
    assert swapped == "st.global.b16" and unswapped == "st.global.b32"
    assert swapped_vector == unswapped_vector == "st.global.v4.b32"


# The output layout's conversion only exists in the Gluon kernel, which runs on Hopper alone;
# elsewhere both cases would run the same Triton substitute.
_ON_HOPPER = gemm._gluon_runs(torch.device(DEVICE))
_VECTOR_STORES = [False, pytest.param(True, marks=pytest.mark.skipif(not _ON_HOPPER, reason="Hopper only"))]


@pytest.mark.parametrize("vector_stores", _VECTOR_STORES, ids=["mma-layout-stores", "vector-stores"])
@pytest.mark.parametrize("tma_scales", [False, True], ids=["scale-loads", "tma-scales"])
@pytest.mark.parametrize("swapped", [True, False], ids=["swapped", "unswapped"])
@pytest.mark.parametrize(
    "split,bf16_partials,unreduced",
    [(1, False, False), (3, False, True), (3, True, True), (3, False, False)],
    ids=["nosplit", "partials", "bf16-partials", "reduced"],
)
def test_same_bits_as_the_equivalent_triton_config(
    split: int, bf16_partials: bool, unreduced: bool, swapped: bool, tma_scales: bool, vector_stores: bool
) -> None:
    """Ragged M, N and K (rows past M and N and columns past K zero-filled by TMA, a last split
    that runs past K): on Hopper the Gluon kernel, elsewhere its substitute; the same bits. With
    `tma_scales` the last M tile's rows past M read the next group's scales (never stored)."""
    m, n, k = (12, 160, 400) if swapped else (68, 96, 400)  # M % 4 == 0: scale copies can run
    w_q, w_s = fp8_weight(n, k)
    x_q, x_s = quant.quantize_activations(torch.randn(m, k, device=DEVICE).to(torch.bfloat16))
    block_m, block_n = (16, 64) if swapped else (64, 32)
    config = gemm.GemmConfig(
        block_m, block_n, split, 4, 2, swap_ab=swapped, bf16_partials=bf16_partials, gluon=True,
        tiles_before_wait=1, tma_scales=tma_scales, vector_stores=vector_stores,
    )  # fmt: skip
    got = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=config, unreduced=unreduced)
    got = got.parts.clone() if isinstance(got, gemm.SplitKPartials) else got
    want = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=_equivalent(config), unreduced=unreduced)
    want = want.parts if isinstance(want, gemm.SplitKPartials) else want
    assert torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 5, 9])
def test_scale_copies_fall_back_to_scale_loads_where_a_copy_cannot_start(m: int) -> None:
    """`tma_scales` at M not a multiple of 4 (the engine's odd batches): the launch loads its
    scales by pointer instead (an unaligned copy start faults) and gives the same bits."""
    n, k = 128, 4096
    w_q, w_s = fp8_weight(n, k)
    x_q, x_s = quant.quantize_activations(torch.randn(m, k, device=DEVICE).to(torch.bfloat16))
    config = gemm.GemmConfig(16, 64, 4, 4, 3, swap_ab=True, gluon=True, tiles_before_wait=2, tma_scales=True)
    got = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=config)
    assert torch.equal(got, gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=_equivalent(config)))


def test_other_activation_modes_run_the_config_without_it() -> None:
    """The FP8 table also serves inline quantization, which the Gluon kernel does not do: its
    swapped Triton tiles run instead (the FP8-only fields, TMA and scales ahead, drop out)."""
    n, k = 128, 256
    w_q, w_s = fp8_weight(n, k)
    x = torch.randn(3, k, device=DEVICE).to(torch.bfloat16)
    config = gemm.GemmConfig(16, 64, 2, 4, 2, swap_ab=True, gluon=True, tiles_before_wait=2)
    got = gemm.fp8_linear(x, w_q, w_s, True, config=config)
    plain = replace(config, gluon=False)
    assert torch.equal(got, gemm.fp8_linear(x, w_q, w_s, True, config=plain))


def test_a_triton_without_this_gluon_runs_the_equivalent_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pyproject.toml` allows Tritons older than the Gluon dialect the kernel is written in: if
    the module does not import, a warning says so and the Triton config runs (never a crash)."""
    monkeypatch.setitem(sys.modules, "shoal.kernels.fp8_gemm_gluon", None)  # import -> ImportError
    gemm._gluon_imports.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="Gluon FP8 GEMM does not load"):
            assert not gemm._gluon_imports()
    finally:
        gemm._gluon_imports.cache_clear()


def _check_in_a_pdl_chain(
    x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, config: gemm.GemmConfig, unreduced: bool
) -> None:
    (m, k), n = x.shape, w_q.shape[0]
    x_q, x_s = quant.quantize_activations(x)
    workspace = gemm.SplitKWorkspace(*gemm.SplitKWorkspace.required(m, n, config), DEVICE)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)

    def step() -> torch.Tensor:
        quant.quantize_activations(x, out=x_q, scales=x_s)
        result = gemm.fp8_gemm(
            x_q, x_s, w_q, w_s, out=out, workspace=workspace, config=config, unreduced=unreduced
        )
        return result.parts if isinstance(result, gemm.SplitKPartials) else result

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        replayed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = gemm.fp8_gemm(
            *quant.quantize_activations(x), w_q, w_s, config=_equivalent(config), unreduced=unreduced
        )
        want = want.parts if isinstance(want, gemm.SplitKPartials) else want
        assert torch.equal(replayed, want), (n, k, m, config)
    result = replayed.float().sum(0) if unreduced and config.split_k > 1 else replayed
    assert rel_err(result, ref.fp8_gemm(x_q, x_s, w_q, w_s)) < 4e-3  # and the torch reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 32, 64])
@pytest.mark.parametrize("shape", list(S2_SHAPES), ids=list(S2_SHAPES))
def test_s2_shapes_in_a_pdl_chain_gpu(m: int, shape: str) -> None:
    """In a CUDA graph, right behind the quantization kernel that writes its input (so the weight
    copies, 0-4 of them, really run ahead of the wait), replayed with new input each time: the
    Triton kernel's bits, partials and reduced results, fp32 and bf16 partials, 64 and 128 rows;
    at M = 64 also unswapped tiles (64 activation rows, 32 or 64 weight columns)."""
    n, k = S2_SHAPES[shape]
    w_q, w_s = fp8_weight(n, k)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    split = gemm.pick_config(n, k, m, x.device, fp8_activations=True).split_k
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    cases = (
        (64, 4, 4, False, True),
        (128, 6, 2, True, True),
        (64, 3, 1, False, False),
        (64, 4, 0, False, True),
    )
    for block_n, stages, ahead, bf16_partials, unreduced in cases:
        config = gemm.GemmConfig(
            block_m, block_n, split, 4, stages, swap_ab=True, bf16_partials=bf16_partials, gluon=True
        )
        _check_in_a_pdl_chain(x, w_q, w_s, replace(config, tiles_before_wait=ahead), unreduced)
    if m < 64:
        return
    unswapped_cases = ((32, 4, 1, True, True), (64, 6, 2, False, False))
    for block_n, stages, ahead, bf16_partials, unreduced in unswapped_cases:
        config = gemm.GemmConfig(64, block_n, split, 4, stages, bf16_partials=bf16_partials, gluon=True)
        _check_in_a_pdl_chain(x, w_q, w_s, replace(config, tiles_before_wait=ahead), unreduced)

"""Fused QK-norm + RoPE + KV write and fused RMSNorm against the torch references."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from kernel_references import qk_norm_rope_reference, rms_norm_reference  # noqa: E402

from shoal.kernels.norm_rope import qk_norm_rope_kv_write, rms_norm  # noqa: E402
from shoal.kernels.quant import new_activation_scales, quantize_activations  # noqa: E402
from shoal.models.layers import rope_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to one bf16 rounding step here and there (fp32 sums in another order)."""
    assert not torch.isnan(out).any(), "NaN: an element was not written"
    diff = (out.float() - ref.float()).abs()
    assert (diff <= 1e-2 * ref.float().abs() + 1e-3).all(), diff.max()
    assert (diff == 0).float().mean() > 0.97


def assert_rotated_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """q/k after norm + RoPE [T, H, D]: a one-ulp difference in a normalized value (fp32 1/sqrt
    vs CUDA's rsqrt, another summation order) crosses a bf16 rounding boundary now and then, and
    the rotation carries it into outputs that may be small where cos and sin terms cancel. So the
    bound is relative to the head's largest value (two bf16 ulps of it), not to each output."""
    assert not torch.isnan(out).any(), "NaN: an element was not written"
    diff = (out.float() - ref.float()).abs()
    head_max = ref.float().abs().amax(dim=-1, keepdim=True)
    ulp = torch.exp2(torch.floor(torch.log2(head_max.clamp_min(1e-30))) - 7)
    assert (diff <= 1e-2 * ref.float().abs() + 2 * ulp).all(), diff.max()
    assert (diff == 0).float().mean() > 0.97


def random_bf16(*shape: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16).to(DEVICE)


@pytest.fixture(params=["per_head", "block"])
def rope_kernel(request, monkeypatch) -> str:
    """Which QK-norm/RoPE/KV-write build runs, whatever the token count: one program per (token,
    head) (decode sizes) or `kernels/norm_rope_block.py` (prefill sizes), by moving the threshold.
    (Split-K partials and e4m3 pools always take the per-head build.)"""
    from shoal.kernels import norm_rope

    monkeypatch.setattr(norm_rope, "BLOCK_KERNEL_FROM_TOKENS", 1 << 30 if request.param == "per_head" else 1)
    return request.param


@pytest.mark.parametrize("hq,hkv,with_norm", [(2, 2, True), (4, 2, False), (8, 2, True)])
def test_qk_norm_rope_kv_write(hq: int, hkv: int, with_norm: bool, rope_kernel: str) -> None:
    gen = torch.Generator().manual_seed(hq * 3 + with_norm)
    tokens, d, page, num_pages = 7, 32, 4, 6
    qkv = random_bf16(tokens, (hq + 2 * hkv) * d, generator=gen, scale=3.0)
    positions = torch.randint(0, 500, (tokens,), generator=gen).to(DEVICE)
    table = rope_table(512, d, 1e6).to(DEVICE)
    q_w = random_bf16(d, generator=gen) if with_norm else None
    k_w = random_bf16(d, generator=gen) if with_norm else None
    slots = torch.randperm(num_pages * page, generator=gen)[:tokens].to(DEVICE)
    slots[3] = -1  # a padding token: nothing written
    k_pages = torch.full((num_pages, page, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v_pages = k_pages.clone()
    k_ref, v_ref = k_pages.clone(), v_pages.clone()
    q = qk_norm_rope_kv_write(qkv, positions, table, k_pages, v_pages, slots, hq, hkv, q_w, k_w, eps=1e-6)
    q_ref = qk_norm_rope_reference(qkv, positions, table, k_ref, v_ref, slots, hq, hkv, q_w, k_w, 1e-6)
    assert_bf16_close(q, q_ref)
    written = slots[slots >= 0]
    pages, offsets = written // page, written % page
    assert_bf16_close(k_pages[pages, offsets], k_ref[pages, offsets])
    assert torch.equal(v_pages[pages, offsets], v_ref[pages, offsets])
    untouched = torch.ones(num_pages * page, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.isnan(k_pages.view(-1, hkv, d)[untouched]).all()


@pytest.mark.parametrize("dim,weight_dtype", [(48, torch.bfloat16), (64, torch.float32)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dim: int, weight_dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(dim + with_residual)
    x = random_bf16(5, dim, generator=gen, scale=4.0)
    weight = (torch.rand(dim, generator=gen) + 0.5).to(weight_dtype).to(DEVICE)
    residual = random_bf16(5, dim, generator=gen) if with_residual else None
    ref, ref_sum = rms_norm_reference(x, weight, 1e-5, residual)
    out, new_residual = rms_norm(x, weight, 1e-5, residual.clone() if with_residual else None)
    assert out.dtype == ref.dtype
    assert_bf16_close(out, ref)
    if with_residual:
        assert torch.equal(new_residual, ref_sum)


@pytest.mark.gpu
def test_full_s2_shapes(rope_kernel: str) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, hq, hkv, d, page = 300, 32, 8, 128, 16
    qkv = random_bf16(tokens, (hq + 2 * hkv) * d, generator=gen, scale=3.0)
    positions = torch.arange(tokens, device=DEVICE) + 1000
    table = rope_table(4096, d, 1e6).to(DEVICE)
    q_w, k_w = random_bf16(d, generator=gen), random_bf16(d, generator=gen)
    slots = torch.arange(tokens, device=DEVICE) + 5 * page
    k_pages = torch.full((40, page, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v_pages = k_pages.clone()
    k_ref, v_ref = k_pages.clone(), v_pages.clone()
    q = qk_norm_rope_kv_write(qkv, positions, table, k_pages, v_pages, slots, hq, hkv, q_w, k_w)
    q_ref = qk_norm_rope_reference(qkv, positions, table, k_ref, v_ref, slots, hq, hkv, q_w, k_w)
    assert_rotated_close(q, q_ref)
    assert_rotated_close(k_pages.view(-1, hkv, d)[slots], k_ref.view(-1, hkv, d)[slots])
    x, residual = random_bf16(64, 2560, generator=gen), random_bf16(64, 2560, generator=gen)
    weight = random_bf16(2560, generator=gen)
    out, _ = rms_norm(x, weight, 1e-6, residual.clone())
    assert_bf16_close(out, rms_norm_reference(x, weight, 1e-6, residual)[0])
    want_q, want_s = quantize_activations(out)
    q = torch.empty(64, 2560, dtype=torch.float8_e4m3fn, device=DEVICE)
    scales = new_activation_scales(64, 2560, DEVICE)
    rms_norm(x, weight, 1e-6, residual.clone(), out_fp8=(q, scales))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_s)
    # the decode step's split rows (four groups per program, residual into a second buffer)
    for rows in (1, 64):
        summed, rows_in = torch.empty_like(residual[:rows]), residual[:rows].clone()
        split, _ = rms_norm(x[:rows], weight, 1e-6, rows_in, residual_out=summed, slice_groups=4)
        assert torch.equal(split, out[:rows])
        assert torch.equal(summed, rms_norm_reference(x[:rows], weight, 1e-6, residual[:rows])[1])
        q_split, s_split = torch.empty_like(q[:rows]), new_activation_scales(rows, 2560, DEVICE)
        rms_norm(x[:rows], weight, 1e-6, residual[:rows].clone(), out_fp8=(q_split, s_split),
                 residual_out=summed, slice_groups=4)  # fmt: skip
        assert torch.equal(q_split.view(torch.uint8), q[:rows].view(torch.uint8))
        assert torch.equal(s_split, scales[:rows])


@pytest.mark.gpu
def test_block_build_matches_the_per_head_build_at_prefill_size(monkeypatch) -> None:
    """A 3,840-token prefill chunk at S2 shapes through both builds: the same v bits, and q and k
    equal but for a bf16 rounding step now and then (each head's mean square summed in another
    order), as both are to torch's reference."""
    from shoal.kernels import norm_rope

    gen = torch.Generator().manual_seed(3)
    tokens, hq, hkv, d, page = 3840, 32, 8, 128, 16
    qkv = random_bf16(tokens, (hq + 2 * hkv) * d, generator=gen, scale=3.0)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    table = rope_table(4096, d, 1e6).to(DEVICE)
    q_w, k_w = random_bf16(d, generator=gen), random_bf16(d, generator=gen)
    slots = torch.randperm(tokens + 64, generator=gen)[:tokens].to(DEVICE)
    slots[::97] = -1
    results = []
    for threshold in (1 << 30, 1):
        monkeypatch.setattr(norm_rope, "BLOCK_KERNEL_FROM_TOKENS", threshold)
        k_pages = torch.zeros(((tokens + 64) // page, page, hkv, d), dtype=torch.bfloat16, device=DEVICE)
        v_pages = k_pages.clone()
        q = qk_norm_rope_kv_write(qkv, positions, table, k_pages, v_pages, slots, hq, hkv, q_w, k_w)
        results.append((q, k_pages, v_pages))
    (q, k, v), (q_block, k_block, v_block) = results
    assert torch.equal(v_block, v)
    assert_rotated_close(q_block, q)
    assert_rotated_close(k_block.view(-1, hkv, d)[slots], k.view(-1, hkv, d)[slots])


@pytest.mark.parametrize("rows,dim", [(1, 256), (3, 320)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_output_equals_separate_quantization(rows: int, dim: int, with_residual: bool) -> None:
    """The fused norm -> FP8 path writes exactly what quantize_activations makes of the bf16 norm
    (dim 320: a partial last 128-column group)."""
    gen = torch.Generator().manual_seed(rows + dim)
    x = random_bf16(rows, dim, generator=gen, scale=2.0)
    residual = random_bf16(rows, dim, generator=gen)
    weight = random_bf16(dim, generator=gen)
    res_a = residual.clone() if with_residual else None
    res_b = residual.clone() if with_residual else None
    normed, res_a = rms_norm(x, weight, 1e-6, res_a)
    want_q, want_s = quantize_activations(normed)
    q, scales = fp8_target(rows, dim)
    (got_q, got_s), res_b = rms_norm(x, weight, 1e-6, res_b, out_fp8=(q, scales))
    assert got_q is q and got_s is scales
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_s)
    if with_residual:
        assert torch.equal(res_a, res_b)


def test_rms_norm_fp8_output_checks_layout() -> None:
    x = torch.zeros(4, 256, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.ones(256, dtype=torch.bfloat16, device=DEVICE)
    q = torch.empty(4, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
    row_major = torch.empty(4, 2, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="group-major"):
        rms_norm(x, weight, 1e-6, out_fp8=(q, row_major))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        rms_norm(x, weight, 1e-6, out_fp8=(q.view(torch.uint8), new_activation_scales(4, 256, DEVICE)))


def fp8_target(rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty `out_fp8` pair for `rms_norm`: e4m3 rows and group-major scales."""
    return torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device=DEVICE), new_activation_scales(
        rows, dim, DEVICE
    )


def assert_same_normed(got, want, quantized: bool) -> None:
    """Bit equality of two `rms_norm` outputs: bf16 rows, or (e4m3, scales) pairs."""
    if quantized:
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1], want[1])
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_row_split_over_programs_gives_the_same_bits(quantized: bool, with_residual: bool) -> None:
    """Rows split into slices of 128-column groups (dim 640: five groups, the last slice partly
    past the row) write what one program per row writes, residual included."""
    rows, dim = 3, 640
    gen = torch.Generator().manual_seed(7 + 2 * quantized + with_residual)
    x = random_bf16(rows, dim, generator=gen, scale=3.0)
    residual = random_bf16(rows, dim, generator=gen) if with_residual else None
    weight = random_bf16(dim, generator=gen)

    def run(slice_groups):
        res_in = residual.clone() if with_residual else None
        res_out = torch.full_like(residual, float("nan")) if with_residual and slice_groups else None
        target = fp8_target(rows, dim) if quantized else None
        normed, new_residual = rms_norm(
            x, weight, 1e-6, res_in, out_fp8=target, residual_out=res_out, slice_groups=slice_groups
        )
        if with_residual and slice_groups:
            assert new_residual is res_out and torch.equal(res_in, residual)  # input left alone
        return normed, new_residual

    whole, whole_residual = run(None)
    for slice_groups in (1, 2):
        split, split_residual = run(slice_groups)
        assert_same_normed(split, whole, quantized)
        if with_residual:
            assert torch.equal(split_residual, whole_residual)


def test_rows_are_a_power_of_two_tile_and_a_tail() -> None:
    """S2-Pro's 2,560 columns: 16 + 4 groups, no masked lanes; widths of a power of two of groups
    take one tile."""
    from shoal.kernels.norm_rope import row_tiles

    assert [row_tiles(d) for d in (2560, 1024, 640, 320, 200, 48)] == [
        (16, 4),
        (8, 0),
        (4, 1),
        (2, 1),
        (2, 0),
        (1, 0),
    ]
    assert row_tiles(128 * 23) == (16, 8)


def test_rms_norm_row_split_refuses_an_in_place_residual() -> None:
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.ones(256, dtype=torch.bfloat16, device=DEVICE)
    residual = torch.zeros_like(x)
    with pytest.raises(ValueError, match="distinct"):
        rms_norm(x, weight, 1e-6, residual, slice_groups=1)
    with pytest.raises(ValueError, match="power of two"):
        rms_norm(x, weight, 1e-6, slice_groups=3)


def tie_partials(rows: int, width: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials [5, rows, width] whose split-order sum is exactly `scales` (a random
    signed power of two per element, returned too) but whose sum in any other order is not: each
    element's partials are (1, 2^-8, 2^-24, 2^-24, 0) x its scale. In split order the sum stays on
    a bf16 rounding tie (rounded down to even); reversed or as a tree, the two tiny terms survive
    in fp32 and push it past the tie."""
    pattern = torch.tensor([1.0, 2.0**-8, 2.0**-24, 2.0**-24, 0.0])
    signs = torch.randint(0, 2, (rows, width), generator=gen) * 2 - 1
    scales = torch.exp2(torch.randint(-6, 7, (rows, width), generator=gen).float()) * signs
    return (pattern[:, None, None] * scales[None]).to(DEVICE), scales.to(DEVICE)


def _partials_case(seed: int, tokens: int, hq: int, hkv: int, d: int, capacity: int):
    """The qkv GEMM's split-K partials for `tokens` tokens (`tie_partials`: only the split-order
    sum gives their bf16 values), with positions, a RoPE table, QK-norm weights and distinct
    slots among `capacity`: (partials, positions, table, q_w, k_w, slots)."""
    from shoal.kernels.fp8_gemm import SplitKPartials

    gen = torch.Generator().manual_seed(seed)
    parts, _ = tie_partials(tokens, (hq + 2 * hkv) * d, gen)
    positions = torch.randint(0, 500, (tokens,), generator=gen).to(DEVICE)
    table = rope_table(512, d, 1e6).to(DEVICE)
    q_w, k_w = random_bf16(d, generator=gen), random_bf16(d, generator=gen)
    slots = torch.randperm(capacity, generator=gen)[:tokens].to(DEVICE)
    return SplitKPartials(parts), positions, table, q_w, k_w, slots


def test_qk_norm_rope_kv_write_sums_split_k_partials_as_the_gemm_would() -> None:
    """Fed the qkv GEMM's partials, the QK-norm/RoPE/KV-write kernel writes q, k and v exactly as
    on the reduced bf16 qkv (`tie_partials`: any other summation order changes every element)."""
    hq, hkv, d, page, num_pages = 4, 2, 32, 4, 4
    partials, positions, table, q_w, k_w, slots = _partials_case(5, 5, hq, hkv, d, page * num_pages)
    results = []
    for qkv in (partials, partials.reduce()):
        k_pages = torch.full((num_pages, page, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        v_pages = k_pages.clone()
        q = qk_norm_rope_kv_write(qkv, positions, table, k_pages, v_pages, slots, hq, hkv, q_w, k_w, eps=1e-6)
        results.append((q, k_pages, v_pages))
    (q, k_pages, v_pages), (q_ref, k_ref, v_ref) = results
    assert q.dtype == torch.bfloat16 and torch.equal(q, q_ref)
    assert torch.equal(k_pages.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_pages.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert torch.equal(v_pages.view(-1, hkv * d)[slots], partials.reduce()[:, (hq + hkv) * d :])


@pytest.mark.parametrize("slice_groups", [None, 1], ids=["row", "split-row"])
@pytest.mark.parametrize("quantized", [False, True])
def test_rms_norm_of_gathered_rows_equals_gather_then_norm(quantized: bool, slice_groups: int | None) -> None:
    """Fed `GatheredRows` (the decode step's code embeddings, ids read in place from a strided
    int32 column of the frames), the norm stores exactly the embedding rows (zero rows for ids
    outside the table) and normalizes them to exactly the bits the norm gives on them."""
    from shoal.kernels.gather_rows import GatheredRows

    rows, dim, vocab = 5, 320, 40  # 320: a last 128-column group only half used
    gen = torch.Generator().manual_seed(21 + 2 * quantized + (slice_groups is None))
    table = random_bf16(vocab, dim, generator=gen, scale=2.0)
    weight = random_bf16(dim, generator=gen)
    frames = torch.randint(0, vocab, (rows, 4), generator=gen, dtype=torch.int32).to(DEVICE)
    frames[1, 2], frames[3, 2] = vocab, -1  # outside the table: zero rows
    ids = frames[:, 2]
    assert ids.stride(0) == 4, "premise: the ids are a strided column"
    valid = (ids >= 0) & (ids < vocab)
    rows_of_ids = torch.nn.functional.embedding(ids.long().clamp(0, vocab - 1), table)
    gathered = torch.where(valid[:, None], rows_of_ids, torch.zeros_like(rows_of_ids))  # +0 rows
    assert (gathered[1] == 0).all() and (gathered[3] == 0).all() and (gathered[0] != 0).any()

    def run(x):
        target = fp8_target(rows, dim) if quantized else None
        return rms_norm(x, weight, 1e-6, out_fp8=target, slice_groups=slice_groups)

    stored = torch.full((rows, dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    fused, fused_rows = run(GatheredRows(ids, table, stored))
    plain, _ = run(gathered)
    assert fused_rows is stored and torch.equal(stored, gathered)
    assert_same_normed(fused, plain, quantized)


def test_rms_norm_of_gathered_rows_checks_its_arguments() -> None:
    from shoal.kernels.gather_rows import GatheredRows

    table = torch.zeros(8, 256, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.ones(256, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    rows = torch.empty(2, 256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="no residual add"):
        rms_norm(GatheredRows(ids, table, rows), weight, 1e-6, residual=rows.clone())
    with pytest.raises(ValueError, match=r"out must be torch.bfloat16 \[2, 256\]"):
        rms_norm(GatheredRows(ids, table, rows[:, :128]), weight, 1e-6)
    with pytest.raises(ValueError, match="1-D integer"):
        rms_norm(GatheredRows(ids.float(), table, rows), weight, 1e-6)


@pytest.mark.parametrize("slice_groups", [None, 1], ids=["row", "split-row"])
@pytest.mark.parametrize("quantized", [False, True])
def test_rms_norm_sums_split_k_partials_as_the_gemm_would(quantized: bool, slice_groups: int | None) -> None:
    """Fed a split-K GEMM's partials (`SplitKPartials`), the norm writes the same bits as on
    the bf16 output the GEMM's own reduction stores (their sum in split order, rounded once), the
    residual stream included (`tie_partials`: any other summation order changes every element)."""
    from shoal.kernels.fp8_gemm import SplitKPartials

    rows, dim = 3, 640
    gen = torch.Generator().manual_seed(11 + 2 * quantized + (slice_groups is None))
    parts, scales = tie_partials(rows, dim, gen)
    partials = SplitKPartials(parts)
    reduced = partials.reduce()
    assert torch.equal(reduced.float(), scales), "premise: the split-order sum rounds down"
    reversed_sum = torch.zeros_like(parts[0])
    for part in parts.flip(0):  # elementwise adds: the same order on every device (`sum` is not)
        reversed_sum += part
    assert (reversed_sum.to(torch.bfloat16) != reduced).all(), "premise: order matters"
    residual = torch.zeros(rows, dim, dtype=torch.bfloat16, device=DEVICE)  # the sum shows as is
    weight = random_bf16(dim, generator=gen)

    def run(x):
        res_in = residual.clone()
        res_out = torch.full_like(residual, float("nan")) if slice_groups else None
        target = fp8_target(rows, dim) if quantized else None
        return rms_norm(
            x, weight, 1e-6, res_in, out_fp8=target, residual_out=res_out, slice_groups=slice_groups
        )

    (fused, fused_residual), (plain, plain_residual) = run(partials), run(reduced)
    assert_same_normed(fused, plain, quantized)
    assert torch.equal(fused_residual, plain_residual)
    # bf16 partials (`GemmConfig.bf16_partials`): summed in fp32 in split order, as `reduce()` does.
    halves = SplitKPartials(parts.to(torch.bfloat16))
    (fused, fused_residual), (plain, plain_residual) = run(halves), run(halves.reduce())
    assert_same_normed(fused, plain, quantized)
    assert torch.equal(fused_residual, plain_residual)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        SplitKPartials(parts.to(torch.float16))


# --- FP8 (e4m3) KV cache: the same kernel writing e4m3 pools and per-(token, kv head) scales ---

UNWRITTEN = 0x7F  # an e4m3 NaN byte: pools start full of it, so a stray write shows


def fp8_pools(num_pages: int, page: int, hkv: int, d: int) -> tuple[torch.Tensor, ...]:
    """(k_pages, v_pages, k_scales, v_scales) of an FP8 KV cache, filled with NaN bytes / NaN."""
    k_pages = torch.full((num_pages, page, hkv, d), UNWRITTEN, dtype=torch.uint8, device=DEVICE)
    k_pages = k_pages.view(torch.float8_e4m3fn)
    k_scales = torch.full((num_pages, page, hkv), float("nan"), device=DEVICE)
    return k_pages, k_pages.clone(), k_scales, k_scales.clone()


def bf16_pools(num_pages: int, page: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    k_pages = torch.full((num_pages, page, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    return k_pages, k_pages.clone()


def write_both_ways(qkv, positions, table, slots, hq, hkv, q_w, k_w, num_pages, page, d):
    """Run the kernel into bf16 pools, then into FP8 pools + scales, on the same inputs.
    Returns (q_bf16_run, k_bf16, v_bf16, q_fp8_run, k8, v8, k_scales, v_scales)."""
    k16, v16 = bf16_pools(num_pages, page, hkv, d)
    q16 = qk_norm_rope_kv_write(qkv, positions, table, k16, v16, slots, hq, hkv, q_w, k_w, eps=1e-6)
    k8, v8, ks, vs = fp8_pools(num_pages, page, hkv, d)
    q8 = qk_norm_rope_kv_write(
        qkv, positions, table, k8, v8, slots, hq, hkv, q_w, k_w, eps=1e-6, k_scales=ks, v_scales=vs
    )
    return q16, k16, v16, q8, k8, v8, ks, vs


def assert_fp8_cache_matches(cache, scales, want_bf16, slots, hkv: int, d: int) -> None:
    """The written slots of an FP8 pool equal `reference.quantize_kv` of `want_bf16` [T, Hkv, D]
    (the bf16 vectors of the same tokens) bit for bit; every other slot is untouched."""
    from shoal.kernels.reference import quantize_kv

    written = slots >= 0
    want_q, want_s = quantize_kv(want_bf16[written])
    got_q = cache.view(-1, hkv, d)[slots[written]]
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales.view(-1, hkv)[slots[written]], want_s)
    untouched = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots[written]] = False
    assert (cache.view(torch.uint8).view(-1, hkv, d)[untouched] == UNWRITTEN).all()
    assert torch.isnan(scales.view(-1, hkv)[untouched]).all()


def gathered(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] vectors of a bf16 pool at `slots` (rows of negative slots: zeros)."""
    flat = pages.view(-1, *pages.shape[2:])
    return torch.where((slots >= 0)[:, None, None], flat[slots.clamp_min(0)], 0)


@pytest.mark.parametrize(
    "hq,hkv,d,with_norm", [(2, 2, 32, True), (4, 2, 32, False), (8, 2, 128, True), (4, 1, 64, False)]
)
def test_fp8_kv_write_is_quantize_kv_of_the_bf16_write(hq: int, hkv: int, d: int, with_norm: bool) -> None:
    """FP8 pools get exactly `reference.quantize_kv` of what the bf16 pools get (k after norm and
    RoPE, v as loaded), one scale per (token, kv head); q is the bf16 run's; padding rows (slot
    -1) leave pages and scales alone. Magnitudes vary per head, and one token has zero k and v
    heads (scale clamped to 1e-12)."""
    gen = torch.Generator().manual_seed(100 + hq * 7 + d + with_norm)
    tokens, page, num_pages = 9, 4, 6
    heads = hq + 2 * hkv
    spread = torch.exp2(torch.randint(-6, 7, (tokens, heads, 1), generator=gen).float()).to(DEVICE)
    qkv = (random_bf16(tokens, heads, d, generator=gen, scale=3.0) * spread).to(torch.bfloat16)
    qkv[2, hq:] = 0  # token 2: all-zero k and v heads
    qkv = qkv.view(tokens, heads * d)
    positions = torch.randint(0, 500, (tokens,), generator=gen).to(DEVICE)
    table = rope_table(512, d, 1e6).to(DEVICE)
    q_w = random_bf16(d, generator=gen) if with_norm else None
    k_w = random_bf16(d, generator=gen) if with_norm else None
    slots = torch.randperm(num_pages * page, generator=gen)[:tokens].to(DEVICE)
    slots[3] = slots[7] = -1  # padding rows
    q16, k16, v16, q8, k8, v8, ks, vs = write_both_ways(
        qkv, positions, table, slots, hq, hkv, q_w, k_w, num_pages, page, d
    )
    assert torch.equal(q8, q16)
    assert_fp8_cache_matches(k8, ks, gathered(k16, slots), slots, hkv, d)
    assert_fp8_cache_matches(v8, vs, gathered(v16, slots), slots, hkv, d)
    assert (vs.view(-1, hkv)[slots[2]] == 1e-12).all() and (v8.view(-1, hkv, d)[slots[2]].float() == 0).all()


def test_fp8_kv_write_sums_split_k_partials() -> None:
    """Fed split-K partials (`tie_partials`: only the split-order sum gives these bf16 values),
    the FP8 pools get `quantize_kv` of what the bf16 pools get from the same partials, which is
    also what the reduced bf16 qkv gives."""
    hq, hkv, d, page, num_pages = 4, 2, 32, 4, 4
    partials, positions, table, q_w, k_w, slots = _partials_case(17, 6, hq, hkv, d, page * num_pages)
    slots[1] = -1
    q16, k16, v16, q8, k8, v8, ks, vs = write_both_ways(
        partials, positions, table, slots, hq, hkv, q_w, k_w, num_pages, page, d
    )
    assert q8.dtype == torch.bfloat16 and torch.equal(q8, q16)
    assert_fp8_cache_matches(k8, ks, gathered(k16, slots), slots, hkv, d)
    assert_fp8_cache_matches(v8, vs, gathered(v16, slots), slots, hkv, d)
    *_, k8_reduced, v8_reduced, ks_reduced, vs_reduced = write_both_ways(
        partials.reduce(), positions, table, slots, hq, hkv, q_w, k_w, num_pages, page, d
    )
    assert torch.equal(k8.view(torch.uint8), k8_reduced.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v8_reduced.view(torch.uint8))
    assert torch.equal(ks.nan_to_num(7.0), ks_reduced.nan_to_num(7.0))
    assert torch.equal(vs.nan_to_num(7.0), vs_reduced.nan_to_num(7.0))


def test_fp8_kv_write_of_fp32_qkv_quantizes_the_rounded_bf16_values() -> None:
    """With fp32 qkv the quantized vectors are those of the bf16 cache values, rounded to nearest
    even (k: the bf16 kernel's k; v: torch's bf16 rounding of the loaded v)."""
    gen = torch.Generator().manual_seed(23)
    tokens, hq, hkv, d, page, num_pages = 5, 2, 2, 32, 4, 4
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) * 3.0).to(DEVICE)
    positions = torch.randint(0, 500, (tokens,), generator=gen).to(DEVICE)
    table = rope_table(512, d, 1e6).to(DEVICE)
    slots = torch.randperm(num_pages * page, generator=gen)[:tokens].to(DEVICE)
    q16, k16, _, q8, k8, v8, ks, vs = write_both_ways(
        qkv, positions, table, slots, hq, hkv, None, None, num_pages, page, d
    )
    assert q8.dtype == torch.float32 and torch.equal(q8, q16)
    assert_fp8_cache_matches(k8, ks, gathered(k16, slots), slots, hkv, d)
    v_bf16 = qkv[:, (hq + hkv) * d :].to(torch.bfloat16).view(tokens, hkv, d)
    assert_fp8_cache_matches(v8, vs, v_bf16, slots, hkv, d)


def test_fp8_kv_write_checks_pools_and_scales() -> None:
    hq, hkv, d, page, num_pages = 2, 2, 32, 4, 3
    qkv = torch.zeros(1, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device=DEVICE)
    positions = torch.zeros(1, dtype=torch.long, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    table = rope_table(8, d, 1e6).to(DEVICE)
    k8, v8, ks, vs = fp8_pools(num_pages, page, hkv, d)
    k16, v16 = bf16_pools(num_pages, page, hkv, d)

    def write(k_pages, v_pages, k_scales=None, v_scales=None):
        return qk_norm_rope_kv_write(
            qkv, positions, table, k_pages, v_pages, slots, hq, hkv, k_scales=k_scales, v_scales=v_scales
        )

    with pytest.raises(ValueError, match="need k_scales and v_scales"):
        write(k8, v8)
    with pytest.raises(ValueError, match="need k_scales and v_scales"):
        write(k8, v8, ks)
    with pytest.raises(ValueError, match="for float8_e4m3fn KV pages only"):
        write(k16, v16, ks, vs)
    with pytest.raises(ValueError, match="for float8_e4m3fn KV pages only"):
        write(k16, v16, None, vs)
    with pytest.raises(ValueError, match="must have the same dtype"):
        write(k8, v16, ks, vs)
    with pytest.raises(ValueError, match="must be contiguous float32"):
        write(k8, v8, ks.to(torch.bfloat16), vs)
    with pytest.raises(ValueError, match="must be contiguous float32"):
        write(k8, v8, ks, vs[:, :, :1])
    with pytest.raises(ValueError, match="must be contiguous float32"):
        write(k8, v8, ks, vs[:-1])
    strided = torch.empty(hkv, page, num_pages, device=DEVICE).permute(2, 1, 0)
    with pytest.raises(ValueError, match="must be contiguous float32"):
        write(k8, v8, strided, vs)
    every_other = fp8_pools(2 * num_pages, page, hkv, d)
    with pytest.raises(ValueError, match="must be contiguous"):
        write(every_other[0][::2], every_other[1][::2], ks, vs)
    wide = fp8_pools(num_pages, page, hkv, 2 * d)
    with pytest.raises(ValueError, match=r"fp8 pages must be \[num_pages"):
        write(wide[0], wide[1], ks, vs)
    write(k8, v8, ks, vs)  # the right pools and scales are taken
    assert not torch.isnan(ks.view(-1, hkv)[0]).any()


@pytest.mark.gpu
def test_fp8_kv_write_full_s2_shapes_in_a_cuda_graph(monkeypatch) -> None:
    """S2 shapes on the GPU, the FP8 write captured in a CUDA graph and replayed: the same bits as
    `quantize_kv` of the bf16 write (cvt/division on the GPU against torch's). e4m3 pools always
    take the per-head build; so does the bf16 write here (at 300 tokens it would take the block
    build, whose q and k may be a bf16 rounding step away)."""
    from shoal.kernels import norm_rope

    monkeypatch.setattr(norm_rope, "BLOCK_KERNEL_FROM_TOKENS", 1 << 30)
    gen = torch.Generator().manual_seed(1)
    tokens, hq, hkv, d, page, num_pages = 300, 32, 8, 128, 16, 40
    qkv = random_bf16(tokens, (hq + 2 * hkv) * d, generator=gen, scale=3.0)
    positions = torch.arange(tokens, device=DEVICE) + 1000
    table = rope_table(4096, d, 1e6).to(DEVICE)
    q_w, k_w = random_bf16(d, generator=gen), random_bf16(d, generator=gen)
    slots = torch.arange(tokens, device=DEVICE) + 5 * page
    slots[::7] = -1
    q16, k16, v16, *_ = write_both_ways(qkv, positions, table, slots, hq, hkv, q_w, k_w, num_pages, page, d)
    k8, v8, ks, vs = fp8_pools(num_pages, page, hkv, d)
    q_out = torch.empty_like(q16)

    def step():
        qk_norm_rope_kv_write(
            qkv, positions, table, k8, v8, slots, hq, hkv, q_w, k_w, eps=1e-6, q_out=q_out,
            k_scales=ks, v_scales=vs,
        )  # fmt: skip

    step()  # compile outside the capture
    k8.view(torch.uint8).fill_(UNWRITTEN), v8.view(torch.uint8).fill_(UNWRITTEN)
    ks.fill_(float("nan")), vs.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_out, q16)
    assert_fp8_cache_matches(k8, ks, gathered(k16, slots), slots, hkv, d)
    assert_fp8_cache_matches(v8, vs, gathered(v16, slots), slots, hkv, d)

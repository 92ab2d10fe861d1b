"""The fused fast-transformer attention layer against the two-kernel path it replaces
(`qk_norm_rope_kv_write` + paged prefill/decode attention), over whole simulated frames."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from shoal.kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from shoal.kernels.fast_attention import fast_rope_attention  # noqa: E402
from shoal.kernels.norm_rope import qk_norm_rope_kv_write  # noqa: E402
from shoal.kernels.quant import new_activation_scales, quantize_activations  # noqa: E402
from shoal.models.layers import rope_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PAGE = 16  # decode_step.FAST_PAGE
CODEBOOKS = 10  # S2: passes 0 (positions 0 and 1), then 2..9


def random_bf16(*shape: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16).to(DEVICE)


def norm_weights(d: int, with_norm: bool, gen: torch.Generator) -> tuple:
    """(q_norm_weight, k_norm_weight), or Nones for layers without QK-norm (S2's fast layers)."""
    return (random_bf16(d, generator=gen), random_bf16(d, generator=gen)) if with_norm else (None, None)


def poisoned_pages(num_pages: int, hkv: int, d: int) -> torch.Tensor:
    """NaN everywhere, so a slot read before it is written, or written by the wrong row, shows."""
    return torch.full((num_pages, PAGE, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)


def frame_passes(batch: int) -> list[tuple[int, torch.Tensor]]:
    """(tokens per row, positions [T]) of each fast pass of a frame, as `decode_step` builds them."""
    passes = [(2, torch.tensor([0, 1], device=DEVICE).repeat(batch))]
    return passes + [(1, torch.full((batch,), k, device=DEVICE)) for k in range(2, CODEBOOKS)]


def two_kernel_path(qkv, positions, table, k_pages, v_pages, tokens_per_row, hq, hkv, weights, out_fp8=None):
    """What `decode_step._layers` runs today for a fast pass: RoPE + KV write, then attention."""
    batch = qkv.shape[0] // tokens_per_row
    rows = torch.arange(batch, device=DEVICE)
    slots = (rows[:, None] * PAGE + positions.view(batch, tokens_per_row)).flatten()
    q = qk_norm_rope_kv_write(qkv, positions, table, k_pages, v_pages, slots, hq, hkv, *weights)
    tables = rows.to(torch.int32)[:, None].contiguous()
    lens = (positions.view(batch, tokens_per_row)[:, -1] + 1).to(torch.int32)
    if tokens_per_row == 1:
        return paged_decode_attention(q, k_pages, v_pages, tables, lens, out_fp8=out_fp8)
    starts = torch.arange(0, 2 * batch + 1, 2, dtype=torch.int32, device=DEVICE)
    return paged_prefill_attention(q, k_pages, v_pages, tables, lens, starts, 2, out_fp8=out_fp8)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equality, NaNs (unwritten slots) included."""
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def assert_within_bf16_rounding(out: torch.Tensor, ref: torch.Tensor, v_max: float) -> None:
    """Both paths compute the same fp32 values up to the summation order inside their dot
    products (other tile shapes), then round once to bf16: an element may land on the
    neighbouring bf16 value, never further, so |out - ref| <= one bf16 ulp of the larger
    magnitude (in the interpreter the outputs are in fact bit-identical).

    On the GPU the reference's other MMA shapes may also sum a score in another order; a
    probability sitting on a bf16 rounding boundary then rounds the other way before the PV
    product, moving its row by at most ulp(p) / l * |v| <= 2**-7 * max|v|. Such rows are rare:
    at most 0.1% of elements may take that wider bound."""
    assert not torch.isnan(out).any(), "NaN: a row was not written, or read an unwritten slot"
    out, ref = out.float(), ref.float()
    diff = (out - ref).abs()
    magnitude = torch.maximum(out.abs(), ref.abs()).clamp_min(2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - 7)
    if INTERPRETED:
        assert (diff <= ulp).all(), diff.max()
    else:
        assert (diff <= ulp).float().mean() >= 0.999, diff.max()
        assert (diff <= ulp + 2.0**-7 * v_max).all(), diff.max()


def run_frame(batch: int, hq: int, hkv: int, d: int, with_norm: bool, seed: int) -> None:
    """A frame's passes through both paths on two copies of the pages; compares every pass.
    One spare page beyond the batch must stay untouched."""
    gen = torch.Generator().manual_seed(seed)
    table = rope_table(CODEBOOKS, d, 1e6).to(DEVICE)
    weights = norm_weights(d, with_norm, gen)
    k_pages, v_pages = poisoned_pages(batch + 1, hkv, d), poisoned_pages(batch + 1, hkv, d)
    k_ref, v_ref = k_pages.clone(), v_pages.clone()
    v_max = 0.0  # the largest |v| any key of the frame so far holds
    for tokens_per_row, positions in frame_passes(batch):
        qkv = random_bf16(positions.shape[0], (hq + 2 * hkv) * d, generator=gen, scale=2.0)
        v_max = max(v_max, qkv[:, (hq + hkv) * d :].float().abs().max().item())
        out = fast_rope_attention(
            qkv, positions, table, k_pages, v_pages, tokens_per_row, hq, hkv, *weights, eps=1e-6
        )
        ref = two_kernel_path(qkv, positions, table, k_ref, v_ref, tokens_per_row, hq, hkv, weights)
        assert_same_bits(k_pages, k_ref)
        assert_same_bits(v_pages, v_ref)
        assert_within_bf16_rounding(out, ref, v_max)
    assert torch.isnan(k_pages[batch]).all() and torch.isnan(v_pages[batch]).all()
    assert not torch.isnan(k_pages[:batch, :CODEBOOKS]).any()


@pytest.mark.parametrize(
    "hq,hkv,with_norm",
    [(8, 2, False), (8, 2, True), (6, 2, True), (2, 2, False)],
    ids=["g4", "g4-norm", "g3-norm", "g1"],
)
def test_frame_matches_two_kernel_path(hq: int, hkv: int, with_norm: bool) -> None:
    run_frame(batch=3, hq=hq, hkv=hkv, d=32, with_norm=with_norm, seed=hq * 10 + with_norm)


@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "norm"])
def test_fp8_output_is_quantized_bf16_output(with_norm: bool) -> None:
    """D = 128: each pass's `out_fp8` equals `quantize_activations` of the same call's bf16
    output bit for bit, and that bf16 output matches the two-kernel path."""
    gen = torch.Generator().manual_seed(40 + with_norm)
    batch, hq, hkv, d = 2, 4, 2, 128
    table = rope_table(CODEBOOKS, d, 1e6).to(DEVICE)
    weights = norm_weights(d, with_norm, gen)
    k_pages, v_pages = poisoned_pages(batch, hkv, d), poisoned_pages(batch, hkv, d)
    k_ref, v_ref = k_pages.clone(), v_pages.clone()
    v_max = 0.0
    for tokens_per_row, positions in frame_passes(batch)[:4]:
        tokens = positions.shape[0]
        qkv = random_bf16(tokens, (hq + 2 * hkv) * d, generator=gen, scale=2.0)
        v_max = max(v_max, qkv[:, (hq + hkv) * d :].float().abs().max().item())
        args = (qkv, positions, table, k_pages, v_pages, tokens_per_row, hq, hkv, *weights)
        out = fast_rope_attention(*args)
        ref = two_kernel_path(qkv, positions, table, k_ref, v_ref, tokens_per_row, hq, hkv, weights)
        assert_within_bf16_rounding(out, ref, v_max)
        q8 = torch.full((tokens, hq * d), 0x7F, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
        scales = new_activation_scales(tokens, hq * d, DEVICE).fill_(float("nan"))
        result = fast_rope_attention(*args, out_fp8=(q8, scales))
        assert result[0] is q8 and result[1] is scales
        want_q8, want_scales = quantize_activations(out.reshape(tokens, -1))
        assert torch.equal(q8.view(torch.uint8), want_q8.view(torch.uint8))
        assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
        assert_same_bits(k_pages, k_ref)  # the second call rewrote the same k/v


def test_garbage_row_stays_in_its_page() -> None:
    """A padding row of a CUDA-graph batch (garbage qkv) changes only its own page and output."""
    gen = torch.Generator().manual_seed(3)
    batch, hq, hkv, d = 3, 4, 2, 32
    table = rope_table(CODEBOOKS, d, 1e6).to(DEVICE)
    positions = torch.full((batch,), 4, device=DEVICE)
    qkv = random_bf16(batch, (hq + 2 * hkv) * d, generator=gen)
    k_pages = random_bf16(batch, PAGE, hkv, d, generator=gen)
    v_pages = random_bf16(batch, PAGE, hkv, d, generator=gen)
    clean_k, clean_v = k_pages.clone(), v_pages.clone()
    clean = fast_rope_attention(qkv, positions, table, clean_k, clean_v, 1, hq, hkv)
    qkv[1] = float("nan")
    out = fast_rope_attention(qkv, positions, table, k_pages, v_pages, 1, hq, hkv)
    for row in (0, 2):
        assert_same_bits(out[row], clean[row])
        assert_same_bits(k_pages[row], clean_k[row])
        assert_same_bits(v_pages[row], clean_v[row])


def test_no_tokens() -> None:
    table = rope_table(CODEBOOKS, 32, 1e6).to(DEVICE)
    pages = poisoned_pages(1, 2, 32)
    qkv = torch.empty(0, 8 * 32, dtype=torch.bfloat16, device=DEVICE)
    positions = torch.empty(0, dtype=torch.long, device=DEVICE)
    out = fast_rope_attention(qkv, positions, table, pages, pages.clone(), 2, 4, 2)
    assert out.shape == (0, 4, 32)


def test_rejects_bad_inputs() -> None:
    hq, hkv, d = 4, 2, 32
    table = rope_table(CODEBOOKS, d, 1e6).to(DEVICE)
    k_pages, v_pages = poisoned_pages(2, hkv, d), poisoned_pages(2, hkv, d)
    qkv = torch.zeros(2, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device=DEVICE)
    positions = torch.tensor([3, 3], device=DEVICE)

    def call(*, qkv=qkv, positions=positions, k_pages=k_pages, tokens_per_row=1, hq=hq, **kwargs):
        return fast_rope_attention(qkv, positions, table, k_pages, v_pages, tokens_per_row, hq, hkv, **kwargs)

    with pytest.raises(ValueError, match="tokens_per_row"):
        call(tokens_per_row=3)
    with pytest.raises(ValueError, match="whole rows"):
        call(qkv=qkv[:1].repeat(3, 1), positions=positions[:1].repeat(3), tokens_per_row=2)
    with pytest.raises(ValueError, match="does not split"):
        call(hq=3)
    with pytest.raises(ValueError, match="share one floating dtype"):
        call(k_pages=k_pages.half())
    with pytest.raises(ValueError, match="need as many pages"):
        call(qkv=qkv.repeat(2, 1), positions=positions.repeat(2))
    with pytest.raises(ValueError, match="positions: need integer"):
        call(positions=positions.float())
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(2, hq, d, dtype=torch.float32, device=DEVICE))
    q8 = torch.empty(2, hq * d, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim == 128"):
        call(out_fp8=(q8, new_activation_scales(2, hq * d, DEVICE)))


@pytest.mark.skipif(DEVICE != "cpu", reason="positions are range-checked only on the CPU (no sync)")
@pytest.mark.parametrize("position", [-1, CODEBOOKS, PAGE])
def test_rejects_positions_outside_the_page(position: int) -> None:
    table = rope_table(CODEBOOKS, 32, 1e6)
    pages = poisoned_pages(2, 2, 32)
    qkv = torch.zeros(2, 8 * 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 10\)"):
        fast_rope_attention(qkv, torch.tensor([0, position]), table, pages, pages.clone(), 1, 4, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 5, 64])
@pytest.mark.parametrize("with_norm", [False, True], ids=["s2", "qk-norm"])
def test_full_s2_shapes(batch: int, with_norm: bool) -> None:
    """S2-Pro's fast layers (Hq 32, Hkv 8, D 128) over whole frames, bf16 and FP8 outputs."""
    run_frame(batch=batch, hq=32, hkv=8, d=128, with_norm=with_norm, seed=batch)
    gen = torch.Generator().manual_seed(100 + batch)
    table = rope_table(CODEBOOKS, 128, 1e6).to(DEVICE)
    weights = norm_weights(128, with_norm, gen)
    k_pages, v_pages = poisoned_pages(batch, 8, 128), poisoned_pages(batch, 8, 128)
    for tokens_per_row, positions in frame_passes(batch):
        tokens = positions.shape[0]
        qkv = random_bf16(tokens, 48 * 128, generator=gen, scale=2.0)
        args = (qkv, positions, table, k_pages, v_pages, tokens_per_row, 32, 8, *weights)
        out = fast_rope_attention(*args)
        q8 = torch.empty(tokens, 32 * 128, dtype=torch.float8_e4m3fn, device=DEVICE)
        scales = new_activation_scales(tokens, 32 * 128, DEVICE)
        fast_rope_attention(*args, out_fp8=(q8, scales))
        want_q8, want_scales = quantize_activations(out.reshape(tokens, -1))
        assert torch.equal(q8.view(torch.uint8), want_q8.view(torch.uint8))
        assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))


def run_frame_on_partials(
    batch: int, hq: int, hkv: int, d: int, with_norm: bool, part_dtype: torch.dtype, splits: int = 3
) -> None:
    """Each pass of a frame twice on copies of the pages: once on a split-K GEMM's partials,
    once on their reduction (`SplitKPartials.reduce`, the GEMM's own bits): the same output, FP8
    output and pages, bit for bit."""
    from shoal.kernels.fp8_gemm import SplitKPartials

    gen = torch.Generator().manual_seed(7 * batch + with_norm)
    table = rope_table(CODEBOOKS, d, 1e6).to(DEVICE)
    weights = norm_weights(d, with_norm, gen)
    k_pages, v_pages = poisoned_pages(batch, hkv, d), poisoned_pages(batch, hkv, d)
    k_ref, v_ref = k_pages.clone(), v_pages.clone()
    width = (hq + 2 * hkv) * d
    for tokens_per_row, positions in frame_passes(batch):
        tokens = positions.shape[0]
        parts = (torch.randn(splits, tokens, width, generator=gen) * 0.7).to(part_dtype).to(DEVICE)
        partials = SplitKPartials(parts)
        reduced = partials.reduce()
        common = (positions, table)
        rest = (tokens_per_row, hq, hkv, *weights)
        got = fast_rope_attention(partials, *common, k_pages, v_pages, *rest)
        want = fast_rope_attention(reduced, *common, k_ref, v_ref, *rest)
        assert_same_bits(got, want)
        assert_same_bits(k_pages, k_ref)
        assert_same_bits(v_pages, v_ref)
        if d == 128:
            pairs = [(torch.empty(tokens, hq * d, dtype=torch.float8_e4m3fn, device=DEVICE),
                      new_activation_scales(tokens, hq * d, DEVICE)) for _ in range(2)]  # fmt: skip
            fast_rope_attention(partials, *common, k_pages, v_pages, *rest, out_fp8=pairs[0])
            fast_rope_attention(reduced, *common, k_ref, v_ref, *rest, out_fp8=pairs[1])
            assert torch.equal(pairs[0][0].view(torch.uint8), pairs[1][0].view(torch.uint8))
            assert torch.equal(pairs[0][1], pairs[1][1])


@pytest.mark.parametrize(
    "part_dtype", [torch.float32, torch.bfloat16], ids=["fp32-partials", "bf16-partials"]
)
@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "norm"])
def test_split_k_partials_give_the_reduced_qkvs_bits(with_norm: bool, part_dtype: torch.dtype) -> None:
    run_frame_on_partials(batch=2, hq=4, hkv=2, d=32, with_norm=with_norm, part_dtype=part_dtype)


@pytest.mark.parametrize("splits", [1, 2, 4, 5])
def test_any_number_of_partials(monkeypatch, splits: int) -> None:
    """Any split count, read as words, gives the reduced qkv's bits."""
    from shoal.kernels import fast_attention

    monkeypatch.setattr(fast_attention, "WORDS_MIN_ROWS", 1)
    run_frame_on_partials(2, 4, 2, 32, with_norm=False, part_dtype=torch.bfloat16, splits=splits)


@pytest.mark.parametrize("splits", [0, 3])
def test_word_reads_give_the_same_bits(monkeypatch, splits: int) -> None:
    """bf16 pairs read as 32-bit words against [..., 2] tiles: the same outputs and pages, bit for
    bit, over a frame (layers without QK-norm: with it the launch reads elements), at batch 1 too
    (words from `WORDS_MIN_ROWS` rows up in the engine)."""
    from shoal.kernels import fast_attention
    from shoal.kernels.fp8_gemm import SplitKPartials

    monkeypatch.setattr(fast_attention, "WORDS_MIN_ROWS", 1)
    batch, hq, hkv, d = 1 + splits % 2, 4, 2, 32
    gen = torch.Generator().manual_seed(11 + splits)
    table = rope_table(CODEBOOKS, d, 1e6).to(DEVICE)
    pages = [poisoned_pages(batch, hkv, d) for _ in range(4)]  # k, v as words; k, v as tiles
    for tokens_per_row, positions in frame_passes(batch):
        shape = (splits, positions.shape[0], (hq + 2 * hkv) * d) if splits else (positions.shape[0], -1)
        qkv = random_bf16(positions.shape[0] * (hq + 2 * hkv) * d * max(splits, 1), generator=gen)
        qkv = SplitKPartials(qkv.view(shape)) if splits else qkv.view(shape)
        rest = (tokens_per_row, hq, hkv)
        words = fast_rope_attention(qkv, positions, table, pages[0], pages[1], *rest)
        monkeypatch.setattr(fast_attention, "PACKED_PAIRS", False)
        tiles = fast_rope_attention(qkv, positions, table, pages[2], pages[3], *rest)
        monkeypatch.setattr(fast_attention, "PACKED_PAIRS", True)
        assert_same_bits(words, tiles)
        assert_same_bits(pages[0], pages[2])
        assert_same_bits(pages[1], pages[3])


def test_unaligned_pairs_are_read_as_elements(monkeypatch) -> None:
    """A qkv view starting 2 bytes into its storage, or with an odd row stride, cannot be read as
    aligned words: the launch falls back to element reads and gives the bits of an aligned copy
    (read as words)."""
    from shoal.kernels import fast_attention
    from shoal.kernels.fast_attention import _reads_words

    monkeypatch.setattr(fast_attention, "WORDS_MIN_ROWS", 1)

    batch, hq, hkv, d = 2, 4, 2, 32
    gen = torch.Generator().manual_seed(5)
    table = rope_table(CODEBOOKS, d, 1e6).to(DEVICE)
    width = (hq + 2 * hkv) * d
    for tokens_per_row, positions in frame_passes(batch)[:2]:
        tokens = positions.shape[0]
        shifted = random_bf16(tokens * width + 1, generator=gen)[1:].view(tokens, width)
        odd_rows = random_bf16(tokens, width + 1, generator=gen)[:, :width]
        for unaligned in (shifted, odd_rows):
            assert not _reads_words(unaligned, unaligned.stride(0)) and _reads_words(unaligned.clone(), width)
            pages = [poisoned_pages(batch, hkv, d) for _ in range(4)]
            rest = (tokens_per_row, hq, hkv)
            got = fast_rope_attention(unaligned, positions, table, pages[0], pages[1], *rest)
            want = fast_rope_attention(unaligned.clone(), positions, table, pages[2], pages[3], *rest)
            assert_same_bits(got, want)
            assert_same_bits(pages[0], pages[2])
            assert_same_bits(pages[1], pages[3])


def test_split_k_partials_with_fp8_output() -> None:
    run_frame_on_partials(batch=1, hq=2, hkv=1, d=128, with_norm=False, part_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_split_k_partials_at_s2_shapes(batch: int) -> None:
    """S2-Pro's fast layers on bf16 partials of 3 splits: the reduced qkv's bits."""
    run_frame_on_partials(batch=batch, hq=32, hkv=8, d=128, with_norm=False, part_dtype=torch.bfloat16)

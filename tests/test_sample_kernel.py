"""Fused sampling kernel against `models.sampling` (through `sample_reference`)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from shoal.kernels import sample as sample_module  # noqa: E402
from shoal.kernels.sample import (  # noqa: E402
    CHUNKED_MAX_ROWS,
    DEFAULT_CHUNKS,
    DEFAULT_CHUNKS_MAX_ROWS,
    _merge_sorted_runs,
    _resolve_chunks,
    _select_top_keys,
    _sort_keys,
    chunk_counters,
    counter_uniform,
    sample_tokens,
)
from shoal.models import sampling  # noqa: E402
from shoal.models.sampling import sample_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def stable_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference breaks ties like the kernel (lower id first) only with a stable sort; torch's
    default CPU sort is not stable (`models/sampling.py` should pass stable=True)."""
    unstable_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: unstable_sort(*a, **{**k, "stable": True}))


def test_counter_uniform_is_bit_exact() -> None:
    seeds = torch.tensor([0, 42, -1, 2**40 + 7, -(2**62), 123456789], device=DEVICE)
    frames = torch.tensor([0, 1, 7, 2**33 + 5, 1000, 3], device=DEVICE)
    for slot in (0, 1, 9):
        got = counter_uniform(seeds, frames, slot, 1500, block=512)
        want = sampling.counter_uniform(seeds, frames, slot, 1500)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def random_params(rows: int, gen: torch.Generator):
    temperature = sampling.round_to_bf16(torch.rand(rows, generator=gen) * 1.2 + 0.1)
    top_p = sampling.round_to_bf16(torch.rand(rows, generator=gen) * 0.9 + 0.1)
    top_k = torch.randint(1, 40, (rows,), generator=gen)
    seed = torch.randint(0, 2**62, (rows,), generator=gen)
    frame = torch.randint(0, 500, (rows,), generator=gen)
    return [t.to(DEVICE) for t in (temperature, top_p, top_k, seed, frame)]


@pytest.mark.parametrize("columns,max_top_k,rows", [(100, None, 16), (300, 64, 6), (1024, 32, 3)])
def test_codebook_rows_match_reference(columns: int, max_top_k: int | None, rows: int) -> None:
    gen = torch.Generator().manual_seed(columns)
    logits = (torch.randn(rows, columns, generator=gen) * 3).to(DEVICE)
    params = random_params(rows, gen)
    if max_top_k is not None:
        params[2] = params[2].clamp(max=max_top_k)
    out = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    sample_tokens(logits, *params, slot=4, max_top_k=max_top_k, out=out)
    assert torch.equal(out, sample_reference(logits, *params, slot=4))


@pytest.mark.parametrize("max_top_k", [None, 16])
def test_bf16_logits_with_ties_break_like_a_stable_sort(max_top_k: int | None, stable_sort: None) -> None:
    """bf16 logits tie often; the kernel keeps the lower id first, as a stable sort does."""
    gen = torch.Generator().manual_seed(1)
    rows, columns = 16, 64
    logits = (torch.randint(-4, 4, (rows, columns), generator=gen) * 0.5).to(torch.bfloat16).to(DEVICE)
    params = random_params(rows, gen)
    if max_top_k is not None:
        params[2] = params[2].clamp(max=max_top_k)
    out = sample_tokens(logits, *params, slot=0, max_top_k=max_top_k)
    assert torch.equal(out, sample_reference(logits.float(), *params, slot=0))


def test_restricted_s2_row_with_ras_writes_into_frames() -> None:
    """Columns = semantic ids 1000..1099 then `<|im_end|>` (id 7); RAS against the window."""
    gen = torch.Generator().manual_seed(2)
    rows, begin, end, im_end = 16, 1000, 1099, 7
    token_ids = torch.cat([torch.arange(begin, end + 1), torch.tensor([im_end])]).to(torch.int32).to(DEVICE)
    logits = (torch.randn(rows, 101, generator=gen) * 2).to(DEVICE)
    logits[:, :5] += 4.0  # a few likely tokens, so the window often holds the normal draw
    params = random_params(rows, gen)
    params[4][:2] = 0  # frame 0: never RAS
    window = torch.randint(begin, begin + 5, (rows, 10, 11), generator=gen, dtype=torch.int32).to(DEVICE)
    frames = torch.full((rows, 11), -1, dtype=torch.int32, device=DEVICE)
    sample_tokens(
        logits, *params, slot=0, token_ids=token_ids, window=window, semantic_range=(begin, end),
        max_top_k=64, out=frames[:, 0],
    )  # fmt: skip
    want = sample_reference(
        logits, *params, slot=0, token_ids=token_ids, window=window, semantic_range=(begin, end)
    )
    assert torch.equal(frames[:, 0].long(), want)
    assert (frames[:, 1:] == -1).all()
    normal = sample_reference(logits, *params, slot=0, token_ids=token_ids)
    assert not torch.equal(normal, want), "the test should exercise at least one RAS replacement"


def test_restricted_row_equals_full_constrained_row() -> None:
    """A restricted row draws what the -inf-masked full vocabulary row draws."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab, begin, end, im_end = 8, 400, 300, 379, 12
    full = torch.randn(rows, vocab, generator=gen) * 2
    allowed = torch.cat([torch.arange(begin, end + 1), torch.tensor([im_end])])
    masked = torch.full_like(full, float("-inf"))
    masked[:, allowed] = full[:, allowed]
    params = random_params(rows, gen)
    restricted = sample_tokens(
        full[:, allowed].to(DEVICE), *params, slot=0, token_ids=allowed.int().to(DEVICE)
    )
    assert torch.equal(restricted.cpu(), sample_reference(masked, *[p.cpu() for p in params], slot=0))


@pytest.mark.gpu
def test_full_s2_shapes() -> None:
    gen = torch.Generator().manual_seed(4)
    rows = 64
    params = random_params(rows, gen)
    logits = (torch.randn(rows, 4097, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    token_ids = torch.arange(150000, 154097, dtype=torch.int32, device=DEVICE)
    window = torch.randint(150000, 150010, (rows, 10, 11), generator=gen, dtype=torch.int32).to(DEVICE)
    ras = {"token_ids": token_ids, "window": window, "semantic_range": (150000, 154095)}
    whole = sample_tokens(logits, *params, slot=0, **ras, max_top_k=64, split_last_column=False)
    want = sample_reference(logits.float(), *params, slot=0, **ras)
    assert (whole == want).float().mean() > 0.98  # GPU exp/log may flip a rare near-tie
    split = sample_tokens(logits, *params, slot=0, **ras, max_top_k=64)
    assert (split == whole).float().mean() > 0.98  # the same keys; `total` is summed in another order
    codes = (torch.randn(rows, 4096, generator=gen) * 3).to(DEVICE)
    got = sample_tokens(codes, *params, slot=3, max_top_k=64)
    assert (got == sample_reference(codes, *params, slot=3)).float().mean() > 0.98


@pytest.mark.parametrize("layout", ["random", "last-likely", "ties", "mostly-inf"])
def test_row_one_past_a_power_of_two_splits_off_its_last_column(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """257 columns (S2's main row has 4,097): the 256-wide tile plus the last column inserted
    afterwards draws what the 512-wide tile draws, RAS included, in every layout that stresses the
    insertion (the last column among the top, tied with others, or nearly alone)."""
    gen = torch.Generator().manual_seed(len(layout))
    rows, columns, begin = 6, 257, 1000
    token_ids = (begin + torch.arange(columns)).to(torch.int32)
    token_ids[-1] = 7  # `<|im_end|>`-like: outside the semantic range
    logits = torch.randn(rows, columns, generator=gen) * 2
    if layout == "last-likely":
        logits[:, -1] = logits.max() + torch.arange(rows) - 3.0  # from rank 0 down to the middle
    elif layout == "ties":  # the reference breaks ties like the kernel only with a stable sort
        logits = (torch.randint(-3, 3, (rows, columns), generator=gen) * 0.5).to(torch.bfloat16).float()
        unstable_sort = torch.sort
        monkeypatch.setattr(torch, "sort", lambda *a, **k: unstable_sort(*a, **{**k, "stable": True}))
    elif layout == "mostly-inf":
        logits[:, 10:-1] = float("-inf")
    params = random_params(rows, gen)
    params[2] = torch.full((rows,), 64, dtype=torch.long, device=DEVICE)  # every candidate counts
    params[1] = torch.ones(rows, device=DEVICE)
    window = torch.randint(begin, begin + 8, (rows, 4, 11), generator=gen, dtype=torch.int32).to(DEVICE)
    args = (logits.to(DEVICE), *params)
    kwargs = {
        "slot": 0,
        "token_ids": token_ids.to(DEVICE),
        "window": window,
        "semantic_range": (begin, begin + 255),
    }
    split = sample_tokens(*args, **kwargs, max_top_k=64)  # split is the default
    whole = sample_tokens(*args, **kwargs, max_top_k=64, split_last_column=False)
    assert torch.equal(split, whole)
    assert torch.equal(
        split.cpu(),
        sample_reference(
            *[a.cpu() for a in args], **{**kwargs, "token_ids": token_ids, "window": window.cpu()}
        ),
    )


# The selection itself: the radix path's K keys against `tl.topk`'s and against torch ------------


@triton.jit
def _top_keys_kernel(
    x_ptr, ids_ptr, scratch_ptr, keys_ptr, sort_ptr, radix_ptr, columns,
    BLOCK: tl.constexpr, K: tl.constexpr, HAS_IDS: tl.constexpr,
):  # fmt: skip
    """The sampling kernel's keys for one row (padding as it pads), then both selections."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < columns
    x = tl.load(x_ptr + row * columns + cols, mask=ok, other=float("-inf"))
    ids = tl.load(ids_ptr + cols, mask=ok, other=0x7FFFFFFF) if HAS_IDS else cols
    keys = _sort_keys(x, ids)
    tl.store(keys_ptr + row * BLOCK + cols, keys.to(tl.int64, bitcast=True))
    i = tl.arange(0, K)
    tl.store(sort_ptr + row * K + i, tl.topk(keys, K).to(tl.int64, bitcast=True))
    radix = _select_top_keys(keys, scratch_ptr + row * (2 * K), BLOCK, K, 2 * K)
    tl.store(radix_ptr + row * K + i, radix.to(tl.int64, bitcast=True))


def top_keys(x: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(all keys [rows, BLOCK], tl.topk's [rows, k], the radix select's [rows, k]), int64 bits."""
    rows, columns = x.shape
    block = max(triton.next_power_of_2(columns), 2 * k)  # the radix path only runs with k < block
    x = x.float().contiguous().to(DEVICE)
    keys = torch.empty(rows, block, dtype=torch.int64, device=DEVICE)
    sort, radix = (torch.empty(rows, k, dtype=torch.int64, device=DEVICE) for _ in range(2))
    scratch = torch.empty(rows, 2 * k, dtype=torch.int64, device=DEVICE)
    ids_arg = ids.to(DEVICE) if ids is not None else keys
    _top_keys_kernel[(rows,)](
        x, ids_arg, scratch, keys, sort, radix, columns, BLOCK=block, K=k, HAS_IDS=ids is not None
    )
    return keys.cpu(), sort.cpu(), radix.cpu()


def largest_unsigned(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of int64 bit patterns read as uint64, descending (with repeats)."""
    flip = torch.tensor(-(2**63), dtype=torch.int64)  # unsigned order = signed order of key ^ 2^63
    return (torch.sort(keys ^ flip, dim=1, descending=True).values[:, :k]) ^ flip


def selection_rows(layout: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [rows, columns] (and column ids) that stress one part of the radix select."""
    if layout == "random":  # fp32: distinct values, resolved in the value bits
        return torch.randn(6, 1000, generator=gen) * 3, None
    if layout == "bf16-ties":  # 8 distinct values over 1000 columns: ~125 ties at the K-th value
        return (torch.randint(-4, 4, (6, 1000), generator=gen) * 0.5).to(torch.bfloat16).float(), None
    if layout == "ties-shuffled-ids":  # ties resolved by ids that are not in column order
        x = (torch.randint(-2, 2, (4, 700), generator=gen) * 0.25).to(torch.bfloat16).float()
        return x, (torch.randperm(700, generator=gen) * 37 + 5).to(torch.int32)
    if layout == "signed-zeros":  # +0.0 and -0.0 are distinct keys; negatives
        x = torch.tensor([0.0, -0.0, -1.0, -0.5])[torch.randint(0, 4, (4, 300), generator=gen)]
        return x, None
    if layout == "few-valid":  # 40 columns in a 128-wide tile, K = 64: padding keys fill up
        return torch.randn(4, 40, generator=gen), None
    if layout == "few-valid-ids":  # padding with token ids: 88 equal padding keys, 24 taken
        return torch.randn(4, 40, generator=gen), torch.arange(900, 940, dtype=torch.int32)
    if layout == "neg-inf":  # 10 finite columns: the K-th largest is -inf, resolved by id
        x = torch.randn(4, 300, generator=gen)
        x[:, 10:] = float("-inf")
        return x, None
    if layout == "outliers-last":  # 63 keys far above a bulk with 100 ties at its top value, in the
        # last columns: a select that stopped early or lost count of the keys above would compact
        # more than 2K candidates and drop the last ones in column order
        x = torch.full((2, 1000), 3.0)
        for row in x:
            row[torch.randperm(937, generator=gen)[:100]] = 3.5
        x[:, 937:] = 100.0 + torch.arange(63)
        return x, None
    if layout == "constant":  # every key equal but for the id
        return torch.full((2, 300), 1.5), None
    if layout == "s2-whole":  # S2's main row in its 8,192 tile with token ids
        return torch.randn(1, 4097, generator=gen).to(torch.bfloat16).float(), torch.arange(
            150000, 154097, dtype=torch.int32
        )
    raise AssertionError(layout)


@pytest.mark.parametrize("k", [2, 64])
@pytest.mark.parametrize(
    "layout",
    [
        "random",
        "bf16-ties",
        "ties-shuffled-ids",
        "signed-zeros",
        "few-valid",
        "few-valid-ids",
        "neg-inf",
        "outliers-last",
        "constant",
        "s2-whole",
    ],
)
def test_radix_select_returns_the_keys_topk_returns(layout: str, k: int) -> None:
    """Bit for bit the K keys `tl.topk` extracts (the sampling kernel's "sort" path) and the K
    largest by torch, in every layout that stresses a step: the digit choice, ties at the K-th
    value resolved in the id bits, padding (also repeated padding keys), -inf, a constant row."""
    gen = torch.Generator().manual_seed(k + len(layout))
    x, ids = selection_rows(layout, gen)
    keys, sort, radix = top_keys(x, k, ids)
    want = largest_unsigned(keys, k)
    assert torch.equal(sort, want)
    assert torch.equal(radix, want)
    if layout in ("bf16-ties", "constant") or (layout == "neg-inf" and k == 64):  # the K-th value ties
        threshold = want[:, -1:] >> 32
        assert ((keys >> 32) == threshold).sum(dim=1).min() > 1


@pytest.mark.parametrize(
    "k,columns,bf16", [(2, 300, False), (64, 300, True), (64, 1000, False), (64, 1000, True)]
)
def test_radix_draws_equal_the_reference_on_random_rows(
    k: int, columns: int, bf16: bool, stable_sort: None
) -> None:
    """Many random rows (64 on the GPU, fewer in the CPU interpreter): the draws of the reference
    (`models/sampling.py`, a stable sort). Flat parameters (top_p 1, top_k K, temperature 1 to
    2.5) spread each draw over all K candidates, so a wrong candidate would show in the draws.
    S2's main row shape: `test_full_s2_shapes`."""
    gen = torch.Generator().manual_seed(k * columns + bf16)
    rows = 64 if DEVICE == "cuda" else 8
    for _ in range(2 if DEVICE == "cuda" or columns < 1000 else 1):
        logits = torch.randn(rows, columns, generator=gen) * 3
        if bf16:
            logits = logits.to(torch.bfloat16)
        params = random_params(rows, gen)
        params[0] = sampling.round_to_bf16(torch.rand(rows, generator=gen) * 1.5 + 1.0).to(DEVICE)
        params[1] = torch.ones(rows, device=DEVICE)
        params[2] = torch.full((rows,), k, dtype=torch.long, device=DEVICE)
        radix = sample_tokens(logits.to(DEVICE), *params, slot=5, max_top_k=k)
        want = sample_reference(logits.float().to(DEVICE), *params, slot=5)
        if DEVICE == "cuda":  # GPU exp/log may flip a rare near-tie
            assert (radix == want).float().mean() > 0.95
        else:
            assert torch.equal(radix, want)
        assert radix.unique().numel() > rows // 2  # the draws do vary


@pytest.mark.parametrize("main", [False, True], ids=["codebook", "s2-main"])
def test_the_benchmarks_sampler_inputs_draw_like_the_reference(main: bool) -> None:
    """`bench.profile.sampler_case` (the inputs `scripts/ncu_sampler.py` times): the kernel takes
    them as the step passes them, and a codebook row draws what the reference draws; the main row
    draws a semantic id or `<|im_end|>`."""
    from shoal.bench.profile import sampler_case

    torch.manual_seed(3)
    logits, params, extra = sampler_case(2, main, DEVICE, scale=3.0)
    out = torch.full((2,), -1, dtype=torch.long, device=DEVICE)
    sample_tokens(logits, *params, slot=0 if main else 3, max_top_k=64, out=out, **extra)
    if main:
        assert ((out >= 0) & (out < logits.shape[1])).all()
    else:
        assert torch.equal(out, sample_reference(logits.float(), *params, slot=3))


# Chunked rows: P programs per row, the last to arrive merging (`chunks`) -------------------------


@triton.jit
def _merge_runs_kernel(keys_ptr, out_ptr, RUNS: tl.constexpr, K: tl.constexpr):
    keys = tl.load(keys_ptr + tl.arange(0, RUNS * K)).to(tl.uint64, bitcast=True)
    merged = _merge_sorted_runs(keys, RUNS, K)
    tl.store(out_ptr + tl.arange(0, K), merged.to(tl.int64, bitcast=True))


@pytest.mark.parametrize("runs,k", [(2, 2), (2, 64), (8, 8), (16, 4)])
def test_merge_sorted_runs_returns_the_largest_keys(runs: int, k: int) -> None:
    """The K largest of RUNS sorted runs (even runs ascending, odd descending, as the chunks store
    them), descending, with repeated keys and keys past 2^63 (unsigned order)."""
    gen = torch.Generator().manual_seed(runs * k)
    flip = torch.tensor(-(2**63), dtype=torch.int64)
    for _ in range(3):
        keys = torch.randint(-(2**62), 2**62, (runs, k), generator=gen) * 2  # both halves of uint64
        keys[:, ::3] = keys[0, 0]  # repeats across and within runs
        ordered = torch.sort(keys ^ flip, dim=1).values ^ flip  # ascending as uint64
        ordered[1::2] = ordered[1::2].flip(1)
        out = torch.empty(k, dtype=torch.int64, device=DEVICE)
        _merge_runs_kernel[(1,)](ordered.flatten().contiguous().to(DEVICE), out, RUNS=runs, K=k)
        assert torch.equal(out.cpu(), largest_unsigned(keys.reshape(1, -1), k)[0])


def chunk_case(shape: str, rows: int, k: int, values: str, gen: torch.Generator):
    """(logits, params, sample_tokens keywords) of one chunked-kernel case: codebook rows of
    `shape` columns ("codebook-4096"), or S2's main row shape ("main-4097": semantic ids then
    `<|im_end|>`, with token ids, a RAS window and the semantic range). `values`: "fp32" (randn *
    3), "bf16" (rounded), "bf16-ties" (8 values: ties at the K-th largest). Flat parameters (top_p
    1, top_k = k, temperature 1 to 2.5) spread the draws over all K candidates, so a wrong or
    misordered candidate shows in them."""
    kind, columns = shape.split("-")
    columns = int(columns)
    if values == "bf16-ties":
        logits = (torch.randint(-4, 4, (rows, columns), generator=gen) * 0.5).to(torch.bfloat16)
    else:
        logits = torch.randn(rows, columns, generator=gen) * 3
        logits = logits.to(torch.bfloat16) if values == "bf16" else logits
    params = random_params(rows, gen)
    params[0] = sampling.round_to_bf16(torch.rand(rows, generator=gen) * 1.5 + 1.0).to(DEVICE)
    params[1] = torch.ones(rows, device=DEVICE)
    params[2] = torch.full((rows,), k, dtype=torch.long, device=DEVICE)
    kwargs = {"slot": 3, "max_top_k": k}
    if kind == "main":
        begin = 150000
        token_ids = (begin + torch.arange(columns)).to(torch.int32)
        token_ids[-1] = 7  # `<|im_end|>`: outside the semantic range
        top = logits.float().topk(4, dim=1).indices  # windows holding likely tokens: RAS replaces some
        window = torch.randint(begin, begin + columns - 1, (rows, 4, 11), generator=gen, dtype=torch.int32)
        window[:, :, 0] = (begin + top.clamp(max=columns - 2)).to(torch.int32)
        kwargs = {
            "slot": 0, "max_top_k": k, "token_ids": token_ids.to(DEVICE), "window": window.to(DEVICE),
            "semantic_range": (begin, begin + columns - 2),
        }  # fmt: skip
    return logits.to(DEVICE), params, kwargs


def assert_chunked_draws_equal(shape: str, rows: int, k: int, values: str, chunks: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(rows * k + len(shape) + len(values))
    logits, params, kwargs = chunk_case(shape, rows, k, values, gen)
    counters = chunk_counters(logits.device)
    whole = sample_tokens(logits, *params, **kwargs, chunks=1)
    frames = torch.full((rows, 3), -1, dtype=torch.int32, device=DEVICE)
    for c in chunks:  # the last into a strided int32 `out`, as the step writes `frames[:, k]`
        last = c == chunks[-1]
        got = sample_tokens(logits, *params, **kwargs, chunks=c, out=frames[:, 1] if last else None)
        got = frames[:, 1].long() if last else got
        assert torch.equal(got, whole), f"chunks={c}"
        assert not counters.any(), "every launch leaves the counters at 0"
    assert (frames[:, ::2] == -1).all()
    if rows > 1:
        assert whole.unique().numel() > 1  # the draws do vary


@pytest.mark.parametrize(
    "shape,rows,k,values,chunks",
    [
        ("codebook-4096", 1, 64, "fp32", (8,)),
        ("codebook-4096", 1, 32, "bf16", (16,)),
        ("codebook-4096", 1, 8, "bf16-ties", (2, 4, 8)),
        ("codebook-1024", 3, 8, "bf16", (4,)),
        ("codebook-256", 16, 8, "bf16-ties", (8,)),
        ("main-4097", 1, 64, "bf16-ties", (8,)),
        ("main-4097", 3, 8, "fp32", (2,)),
        ("main-257", 16, 16, "fp32", (4,)),
    ],
)
def test_chunked_draws_equal_one_program_per_row(
    shape: str, rows: int, k: int, values: str, chunks: tuple[int, ...]
) -> None:
    """Bit for bit the one-program kernel's draws (chunks=1), for codebook rows and S2's main row
    (its last column inserted after the merge, RAS), with ties at the K-th value; the counters back
    at 0 after every launch. Batches 3 and 16 run narrower rows here, as do most chunk counts (the
    interpreter takes about a second per program of 4,096 columns); `test_chunked_full_shapes` runs
    every count at the step's shapes and batches on the GPU."""
    assert_chunked_draws_equal(shape, rows, k, values, chunks)


@pytest.mark.gpu
def test_chunked_full_shapes() -> None:
    """Every chunk count at the step's shapes and batches, and inside a replayed CUDA graph."""
    for shape in ("codebook-4096", "main-4097"):
        for rows in (1, 3, 16, 64):
            for k in (64, 32, 8):
                for values in ("fp32", "bf16", "bf16-ties"):
                    assert_chunked_draws_equal(shape, rows, k, values, (2, 4, 8, 16))
    gen = torch.Generator().manual_seed(5)
    logits, params, kwargs = chunk_case("main-4097", 16, 64, "bf16", gen)
    outs = torch.empty(3, 16, dtype=torch.long, device=DEVICE)

    def step() -> None:
        for i in range(3):
            sample_tokens(logits, *params, **kwargs, chunks=8, out=outs[i])

    from shoal.bench.timing import capture_graph

    graph = capture_graph(step)
    for _ in range(4):
        fresh, fresh_params, _ = chunk_case("main-4097", 16, 64, "bf16", gen)
        logits.copy_(fresh)
        for param, value in zip(params, fresh_params, strict=True):
            param.copy_(value)
        graph.replay()
        want = sample_tokens(logits, *params, **kwargs, chunks=1)
        assert all(torch.equal(out, want) for out in outs)
        assert not chunk_counters(logits.device).any()


def test_chunks_default_preference_and_fallbacks() -> None:
    assert _resolve_chunks(None, 1, 4096, 64, True) == DEFAULT_CHUNKS
    assert _resolve_chunks(None, DEFAULT_CHUNKS_MAX_ROWS, 4096, 64, True) == DEFAULT_CHUNKS
    assert _resolve_chunks(None, DEFAULT_CHUNKS_MAX_ROWS + 1, 4096, 64, True) == 1
    assert _resolve_chunks(None, 1, 4096, 64, False) == 1  # not the radix path on a GPU
    assert _resolve_chunks(None, 1, 256, 64, True) == (DEFAULT_CHUNKS if 256 // DEFAULT_CHUNKS >= 64 else 1)
    # `Tuning.sample_chunks` (validated there: a power of two) arrives as the preference
    assert _resolve_chunks(None, 64, 4096, 64, False, 4) == 4  # the preference holds at any batch
    assert _resolve_chunks(None, 1, 128, 64, True, 4) == 1  # chunks narrower than k: one program
    assert _resolve_chunks(None, CHUNKED_MAX_ROWS + 1, 4096, 64, True, 4) == 1
    assert _resolve_chunks(2, 1, 4096, 64, True, 4) == 2  # an explicit value wins
    assert _resolve_chunks(None, 1, 4096, 64, True, 1) == 1


class LaunchSpy:
    """Stands in for a kernel: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_preferred_chunks_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """`preferred_chunks` (the step's `Tuning.sample_chunks`) picks the chunked kernel; explicit
    values the shape cannot take raise."""
    gen = torch.Generator().manual_seed(11)
    logits, params, kwargs = chunk_case("main-257", 2, 16, "fp32", gen)
    spy = LaunchSpy(sample_module._sample_chunked_kernel)
    monkeypatch.setattr(sample_module, "_sample_chunked_kernel", spy)
    got = sample_tokens(logits, *params, **kwargs, preferred_chunks=4)
    assert spy.grids == [(2, 4)]
    assert torch.equal(got, sample_tokens(logits, *params, **kwargs, preferred_chunks=1))
    assert spy.grids == [(2, 4)]  # one program per row
    for bad in (3, 0, -2, True, 2.0, 32):  # 32: chunks of 8 columns, narrower than k = 16
        with pytest.raises(ValueError, match="chunks"):
            sample_tokens(logits, *params, **kwargs, chunks=bad)
    with pytest.raises(ValueError, match="chunks"):
        sample_tokens(logits, *params, **{**kwargs, "max_top_k": None}, chunks=2)  # k = the whole tile
    assert spy.grids == [(2, 4)]

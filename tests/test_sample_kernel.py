"""Fused sampling kernel against `models.sampling` (through `sample_reference`)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from shoal.kernels.reference_attention import sample_reference  # noqa: E402
from shoal.kernels.sample import counter_uniform, sample_tokens  # noqa: E402
from shoal.models import sampling  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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


def test_bf16_logits_with_ties_break_like_a_stable_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 logits tie often; the kernel keeps the lower id first, as the reference does when its
    sort is stable (torch's default CPU sort is not; `models/sampling.py` should pass stable=True)."""
    unstable_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: unstable_sort(*a, **{**k, "stable": True}))
    gen = torch.Generator().manual_seed(1)
    rows, columns = 16, 64
    logits = (torch.randint(-4, 4, (rows, columns), generator=gen) * 0.5).to(torch.bfloat16).to(DEVICE)
    params = random_params(rows, gen)
    out = sample_tokens(logits, *params, slot=0)
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
    got = sample_tokens(
        logits,
        *params,
        slot=0,
        token_ids=token_ids,
        window=window,
        semantic_range=(150000, 154095),
        max_top_k=64,
    )
    want = sample_reference(
        logits.float(), *params, slot=0, token_ids=token_ids, window=window, semantic_range=(150000, 154095)
    )
    assert (got == want).float().mean() > 0.98  # GPU exp/log may flip a rare near-tie
    split = sample_tokens(
        logits, *params, slot=0, token_ids=token_ids, window=window, semantic_range=(150000, 154095),
        max_top_k=64, split_last_column=True,
    )  # fmt: skip
    assert (split == got).float().mean() > 0.98  # the same keys; `total` is summed in another order
    codes = (torch.randn(rows, 4096, generator=gen) * 3).to(DEVICE)
    got = sample_tokens(codes, *params, slot=3)
    assert (got == sample_reference(codes, *params, slot=3)).float().mean() > 0.98


@pytest.mark.parametrize("layout", ["random", "last-likely", "ties", "mostly-inf"])
def test_row_one_past_a_power_of_two_splits_off_its_last_column(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """257 columns (S2's main row has 4,097): the 256-wide network plus the last column inserted
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
    split = sample_tokens(*args, **kwargs, max_top_k=64, split_last_column=True)
    whole = sample_tokens(*args, **kwargs, max_top_k=64)
    assert torch.equal(split, whole)
    assert torch.equal(
        split.cpu(),
        sample_reference(
            *[a.cpu() for a in args], **{**kwargs, "token_ids": token_ids, "window": window.cpu()}
        ),
    )

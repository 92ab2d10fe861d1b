"""`kernels/gather_rows.py`: the fast passes' embedding lookup, against `F.embedding`."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shoal.bench.timing import capture_graph  # noqa: E402
from shoal.kernels.gather_rows import BLOCK_D, gather_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dim", [64, BLOCK_D + 96])
def test_strided_int32_ids_equal_embedding(dim: int) -> None:
    """ids as the engine passes them, a strided int32 column of `frames`; rows wider than one
    program; the same bits as the embedding, into a given `out` too."""
    gen = torch.Generator().manual_seed(dim)
    table = torch.randn(50, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    frames = torch.randint(0, 50, (6, 11), generator=gen, dtype=torch.int32).to(DEVICE)
    ids = frames[:, 4]
    want = F.embedding(ids.long(), table)
    assert torch.equal(gather_rows(ids, table), want)
    out = torch.full((6, dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert gather_rows(ids.long(), table, out=out) is out and torch.equal(out, want)


def test_out_of_range_ids_give_zero_rows() -> None:
    table = torch.ones(4, 8, dtype=torch.bfloat16, device=DEVICE)
    out = gather_rows(torch.tensor([1, 4, -1], device=DEVICE), table)
    assert torch.equal(out[0], table[1]) and not out[1:].any()


def test_bad_inputs_are_refused() -> None:
    table = torch.zeros(4, 8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="1-D integer"):
        gather_rows(torch.zeros(3, device=DEVICE), table)
    with pytest.raises(ValueError, match="contiguous rows"):
        gather_rows(torch.zeros(3, dtype=torch.int32, device=DEVICE), table.t())
    with pytest.raises(ValueError, match="out must be"):
        gather_rows(
            torch.zeros(3, dtype=torch.int32, device=DEVICE), table, out=torch.zeros(3, 8, device=DEVICE)
        )
    assert gather_rows(torch.zeros(0, dtype=torch.int32, device=DEVICE), table).shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_a_graph_behind_the_writer_gpu() -> None:
    """Captured in a CUDA graph behind the copy that writes the ids: each replay gathers the ids
    of that replay."""
    table = torch.randn(4096, 2560, device=DEVICE).to(torch.bfloat16)
    source = torch.zeros(64, 11, dtype=torch.int32, device=DEVICE)
    frames = torch.zeros_like(source)
    out = torch.empty(64, 2560, dtype=torch.bfloat16, device=DEVICE)

    def step() -> None:
        frames.copy_(source)
        gather_rows(frames[:, 3], table, out=out)

    graph = capture_graph(step)  # warm-up calls outside the capture
    for seed in range(3):
        source.copy_(torch.randint(0, 4096, source.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, F.embedding(source[:, 3].long(), table))

"""The in-place window shift kernel against the torch reference and `push_frames`."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from shoal.bench.timing import capture_graph  # noqa: E402
from shoal.kernels.reference_attention import window_shift_reference  # noqa: E402
from shoal.kernels.window import window_shift  # noqa: E402
from shoal.models.sampling import push_frames  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("bs,width,columns", [(1, 10, 11), (3, 16, 11), (2, 1, 5)])
def test_window_shift_matches_reference(bs: int, width: int, columns: int) -> None:
    gen = torch.Generator().manual_seed(bs * width)
    window = torch.randint(0, 2**31 - 1, (bs, width, columns), generator=gen, dtype=torch.int32).to(DEVICE)
    frames = torch.randint(0, 2**31 - 1, (bs, columns), generator=gen, dtype=torch.int32).to(DEVICE)
    expected = window.clone()
    window_shift_reference(expected, frames)
    pointer = window.data_ptr()
    for _ in range(2):  # twice: the second shift reads what the first one wrote
        window_shift(window, frames)
        frames = frames + 1
        if _ == 0:
            assert torch.equal(window, expected)
            window_shift_reference(expected, frames)
    assert torch.equal(window, expected)
    assert window.data_ptr() == pointer and window.dtype == torch.int32


def test_window_shift_on_a_batch_slice_and_frame_zero_rows() -> None:
    """A strided view (the live rows of a larger graph buffer) and rows at frame 0 kept."""
    gen = torch.Generator().manual_seed(5)
    buffer = torch.randint(0, 1000, (4, 10, 11), generator=gen, dtype=torch.int32).to(DEVICE)
    frames = torch.randint(0, 1000, (4, 11), generator=gen, dtype=torch.int32).to(DEVICE)
    frame_index = torch.tensor([0, 3, 1, 0], device=DEVICE)
    expected = buffer.clone()
    push_frames(expected, frames, frame_index)
    window_shift(buffer, frames, frame_index)
    assert torch.equal(buffer, expected)
    before = buffer.clone()
    window_shift(buffer[1:3], frames[1:3])
    window_shift_reference(before[1:3], frames[1:3])
    assert torch.equal(buffer, before)


@pytest.mark.parametrize("with_frame_index", [True, False])
def test_window_shift_also_stores_tokens(with_frame_index: bool) -> None:
    """`tokens` (a strided view, poisoned first) gets the new frames in every row, frame 0 rows
    included; the window moves as without it; the buffer around the view is untouched."""
    gen = torch.Generator().manual_seed(9)
    window = torch.randint(0, 1000, (4, 10, 11), generator=gen, dtype=torch.int32).to(DEVICE)
    frames = torch.randint(0, 1000, (4, 11), generator=gen, dtype=torch.int32).to(DEVICE)
    frame_index = torch.tensor([0, 3, 1, 0], device=DEVICE) if with_frame_index else None
    expected = window.clone()
    if frame_index is None:
        window_shift_reference(expected, frames)
    else:
        push_frames(expected, frames, frame_index)
    buffer = torch.full((4, 13), -7, dtype=torch.int32, device=DEVICE)
    window_shift(window, frames, frame_index, tokens=buffer[:, 1:12])
    assert torch.equal(window, expected)
    assert torch.equal(buffer[:, 1:12], frames)
    assert (buffer[:, 0] == -7).all() and (buffer[:, 12] == -7).all()


def test_rejects_bad_tokens() -> None:
    window = torch.zeros(2, 10, 11, dtype=torch.int32, device=DEVICE)
    frames = torch.zeros(2, 11, dtype=torch.int32, device=DEVICE)
    for tokens in (
        torch.zeros(2, 11, dtype=torch.int64, device=DEVICE),
        torch.zeros(3, 11, dtype=torch.int32, device=DEVICE),
        torch.zeros(11, 2, dtype=torch.int32, device=DEVICE).t(),
    ):
        with pytest.raises(ValueError, match=r"tokens must be torch.int32 \[2, 11\]"):
            window_shift(window, frames, tokens=tokens)


def test_rejects_promoted_or_misshaped_frames() -> None:
    window = torch.zeros(2, 10, 11, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError):
        window_shift(window, torch.zeros(2, 11, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError):
        window_shift(window, torch.zeros(2, 1, 11, dtype=torch.int32, device=DEVICE))


@pytest.mark.gpu
def test_window_shift_in_a_cuda_graph() -> None:
    window = torch.randint(0, 1000, (64, 10, 11), dtype=torch.int32, device="cuda")
    frames = torch.randint(0, 1000, (64, 11), dtype=torch.int32, device="cuda")
    window_shift(window, frames)  # compile outside the capture
    expected = window.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        window_shift(window, frames)
    window.copy_(expected)
    for _ in range(3):
        graph.replay()
        window_shift_reference(expected, frames)
    torch.cuda.synchronize()
    assert torch.equal(window, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_window_shift_stores_tokens_in_a_graph_behind_the_writer() -> None:
    """Captured behind the copy that writes the frames: each replay stores that replay's frames."""
    source = torch.zeros(64, 11, dtype=torch.int32, device="cuda")
    frames, tokens = torch.zeros_like(source), torch.zeros_like(source)
    window = torch.zeros(64, 10, 11, dtype=torch.int32, device="cuda")
    frame_index = torch.arange(64, device="cuda") % 3

    def step() -> None:
        frames.copy_(source)
        window_shift(window, frames, frame_index, tokens=tokens)

    graph = capture_graph(step)  # warm-up calls outside the capture
    for seed in range(3):
        source.copy_(torch.randint(0, 1000, source.shape, generator=torch.Generator().manual_seed(seed)))
        expected = window.clone()
        push_frames(expected, source, frame_index)
        tokens.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(tokens, source) and torch.equal(window, expected)

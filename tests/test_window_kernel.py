"""The in-place window shift kernel against the torch reference and `push_frames`."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

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

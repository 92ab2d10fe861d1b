"""The in-place window shift kernel against the torch reference and `push_frames`."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from kernel_references import window_shift_reference  # noqa: E402

from shoal.bench.timing import capture_graph  # noqa: E402
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


def test_window_shift_advances_the_step_and_fills_the_ring() -> None:
    """`advance`: live rows (frame index >= 1) get position, KV length and frame index one up and
    the slot of the new position from their block table (the next page when a page fills; a row
    whose next position is past its table keeps its metadata), and their frame in ring slot
    frame_index % R; padding rows (frame index 0) keep their metadata and write no ring slot.
    The window moves as without it."""
    from shoal.kernels.window import StepAdvance

    page, rows, columns = 4, 4, 3
    frames = torch.arange(rows * columns, dtype=torch.int32).view(rows, columns).to(DEVICE) + 100
    frame_index = torch.tensor([5, 0, 1, 2], device=DEVICE)
    positions = torch.tensor([9, 0, 2, 11], device=DEVICE)
    kv_lens = torch.tensor([10, 1, 3, 12], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([-5, 77, -5, -5], device=DEVICE)
    tables = torch.tensor([[3, 8, 6], [9, 9, 9], [2, 4, 0], [1, 5, 7]], dtype=torch.int32, device=DEVICE)
    ring = torch.full((4, rows + 2, columns), -1, dtype=torch.int32, device=DEVICE)
    window = torch.zeros(rows, 2, columns, dtype=torch.int32, device=DEVICE)
    expected_window = window.clone()
    push_frames(expected_window, frames, frame_index)
    advance = StepAdvance(positions, kv_lens, slots, tables, page, ring)
    window_shift(window, frames, frame_index, advance=advance)
    assert torch.equal(window, expected_window)
    # row 0: position 10 in page 2 of its table (6) at offset 2; row 2: position 3, page 0 (2)
    # offset 3; row 3: position 12 is past its 3-page table, so it keeps its metadata; row 1
    # (padding) keeps its own.
    assert positions.tolist() == [10, 0, 3, 11]
    assert kv_lens.tolist() == [11, 1, 4, 12]
    assert frame_index.tolist() == [6, 0, 2, 2]
    assert slots.tolist() == [6 * page + 2, 77, 2 * page + 3, -5]
    assert torch.equal(ring[5 % 4, 0], frames[0]) and torch.equal(ring[1, 2], frames[2])
    assert torch.equal(ring[2, 3], frames[3])
    written = torch.zeros_like(ring, dtype=torch.bool)
    written[1, 0] = written[1, 2] = written[2, 3] = True
    assert (ring[~written] == -1).all()  # padding row 1 and the rows past the batch untouched
    with pytest.raises(ValueError, match="frame_index"):
        window_shift(window, frames, None, advance=advance)
    with pytest.raises(ValueError, match="ring"):
        window_shift(
            window,
            frames,
            frame_index,
            advance=StepAdvance(positions, kv_lens, slots, tables, page, ring[:, :2]),
        )

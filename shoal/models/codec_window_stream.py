"""Streaming decode by windows: each step decodes the new frames with the frames just before them.

For a codec whose decode path is only causal convolutions (Fish Speech 1.5's Firefly,
`codec_firefly.py`), a sample depends on a bounded number of earlier frames
(`FireflyCodec.decode_context_frames`). So decoding frames [start - context, end) gives frames
[start, end) the samples a decode from the first frame gives them (up to floating-point
reassociation in the convolutions), and each stream only carries its last `context` codes. The
modded DAC codec cannot stream this way (its transformer sees 1,016 frames back) and carries
every layer's state instead (`codec_stream.py`).

The cost is the context: a step of t new frames decodes context + t. The pool has the
interface the vocoder uses (`open`, `step`, `capture_cuda_graphs`); its steps run eagerly, since
a stream's window is shorter than context + t until it has that many frames.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class WindowedCodec(Protocol):
    num_codebooks: int
    frame_length: int
    device: torch.device
    dtype: torch.dtype

    def decode(self, codes: Tensor) -> Tensor: ...


class WindowStream:
    """One request's stream: its slot in the pool, frames decoded so far, the last codes."""

    def __init__(self, pool: WindowStreamPool, slot: int):
        self.pool, self.slot, self.frames = pool, slot, 0
        self.history = torch.zeros(pool.codec.num_codebooks, 0, dtype=torch.long)

    def close(self) -> None:
        self.pool.release(self)


class WindowStreamPool:
    """Up to `max_streams` concurrent streams of one codec, `context` frames of codes each."""

    def __init__(self, codec: WindowedCodec, max_streams: int, context: int):
        if context < 0:
            raise ValueError(f"context must be >= 0 frames, got {context}")
        self.codec, self.max_streams, self.context = codec, max_streams, context
        self._free = list(range(max_streams - 1, -1, -1))

    def state_bytes_per_stream(self) -> int:
        return self.codec.num_codebooks * self.context * 8  # int64 codes on the host

    def open(self) -> WindowStream:
        if not self._free:
            raise RuntimeError(f"all {self.max_streams} codec streams are in use")
        return WindowStream(self, self._free.pop())

    def release(self, stream: WindowStream) -> None:
        if stream.slot is not None:
            self._free.append(stream.slot)
            stream.slot = None

    @torch.inference_mode()
    def step(self, streams: list[WindowStream], codes: list[Tensor]) -> list[Tensor]:
        """Decode each stream's new frames codes[i] [num_codebooks, t_i] (t_i may differ, may be
        0) in one batched decode; returns each stream's new audio [t_i * frame_length]."""
        if len({s.slot for s in streams}) != len(streams) or any(s.slot is None for s in streams):
            raise ValueError("each open stream may appear once per step")
        frame = self.codec.frame_length
        windows, starts = [], []
        for stream, new in zip(streams, codes, strict=True):
            new = new.detach().to("cpu", torch.long)
            if new.dim() != 2 or new.shape[0] != self.codec.num_codebooks:
                raise ValueError(f"codes must be [{self.codec.num_codebooks}, frames], got {list(new.shape)}")
            windows.append(torch.cat([stream.history, new], dim=1))
            starts.append(stream.history.shape[1])
        empty = torch.zeros(0, device=self.codec.device, dtype=self.codec.dtype)
        busy = [i for i, (w, s) in enumerate(zip(windows, starts, strict=True)) if w.shape[1] > s]
        outputs = [empty] * len(streams)
        if busy:
            # Left-aligned, right-padded: causality keeps the padding out of every real sample.
            width = max(windows[i].shape[1] for i in busy)
            packed = torch.zeros(len(busy), self.codec.num_codebooks, width, dtype=torch.long)
            for row, i in enumerate(busy):
                packed[row, :, : windows[i].shape[1]] = windows[i]
            audio = self.codec.decode(packed.to(self.codec.device))[:, 0]
            for row, i in enumerate(busy):
                outputs[i] = audio[row, starts[i] * frame : windows[i].shape[1] * frame].clone()
        for stream, window in zip(streams, windows, strict=True):
            stream.frames += window.shape[1] - stream.history.shape[1]
            stream.history = window[:, window.shape[1] - min(self.context, window.shape[1]) :].clone()
        return outputs

    def capture_cuda_graphs(self, batch_sizes: list[int], chunk_frames: list[int]) -> None:
        """Nothing to capture: the windows' widths vary while streams start (see the module
        docstring), so every step runs eagerly."""

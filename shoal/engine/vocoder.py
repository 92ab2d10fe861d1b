"""Batched streaming codec decode across requests, on its own thread.

The engine thread pushes each request's new frames; the vocoder thread decodes the pending
frames of every stream that has enough of them (`chunk_frames`, or `first_chunk_frames` for a
stream's first audio, or whatever is left at its end) in one `CodecStreamPool.step`, and hands
the audio to the stream's callback. Each stream holds back its latest frame: the reference
hands the codec every frame of a text batch but the last (the `<|im_end|>` frame, or the
final one at max length), so a frame is released only once the next one exists.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

AudioCallback = Callable[[np.ndarray, np.ndarray], None]  # (samples float32 [n], frames int32 [f, N+1])
DoneCallback = Callable[[], None]


class VocoderStream:
    """One text batch of one request: frames in, audio out."""

    def __init__(self, on_audio: AudioCallback) -> None:
        self.on_audio = on_audio
        self.pending: list[torch.Tensor] = []  # frames released for decoding, [N+1] each
        self.held: torch.Tensor | None = None  # the latest frame, not yet known not to be last
        self.ending: DoneCallback | None = None  # set by end(): flush, then call it
        self.closed = False
        self.emitted = False
        self.codec_stream = None


class Vocoder:
    def __init__(self, codec, max_streams: int, chunk_frames: int = 8, first_chunk_frames: int = 4) -> None:
        self.codec = codec
        self.pool = codec.stream_pool(max_streams)
        self.chunk_frames = chunk_frames
        self.first_chunk_frames = first_chunk_frames
        self._streams: list[VocoderStream] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    # Engine thread -------------------------------------------------------------------------

    def open(self, on_audio: AudioCallback) -> VocoderStream:
        stream = VocoderStream(on_audio)
        with self._wake:
            self._streams.append(stream)
        return stream

    def push(self, stream: VocoderStream, frames: torch.Tensor) -> None:
        """New frames int32 [n, N+1] of the stream, in order."""
        with self._wake:
            for frame in frames:
                if stream.held is not None:
                    stream.pending.append(stream.held)
                stream.held = frame.clone()
            self._wake.notify_all()

    def end(self, stream: VocoderStream, done: DoneCallback, drop: bool = False) -> None:
        """The batch is over: its held frame is dropped (the reference's last-frame quirk), the
        rest is decoded, then `done` runs on the vocoder thread. `drop`: discard pending too."""
        with self._wake:
            stream.held = None
            if drop:
                stream.pending.clear()
            stream.ending = done
            self._wake.notify_all()

    # Vocoder thread ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="shoal-vocoder", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _ready(self, stream: VocoderStream) -> bool:
        need = self.chunk_frames if stream.emitted else self.first_chunk_frames
        return len(stream.pending) >= need or stream.ending is not None

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not any(self._ready(s) for s in self._streams):
                    self._wake.wait()
                if self._stopping:
                    return
                batch = [s for s in self._streams if self._ready(s)]
                work = [(s, s.pending, s.ending) for s in batch]
                for s in batch:
                    s.pending = []
                    if s.ending is not None:
                        self._streams.remove(s)
            self.decode(work)

    def decode(self, work: list[tuple[VocoderStream, list[torch.Tensor], DoneCallback | None]]) -> None:
        """Decode one batch of streams' frames in one codec call and deliver the audio."""
        with_frames = [(s, frames) for s, frames, _ in work if frames]
        if with_frames:
            for stream, _ in with_frames:
                if stream.codec_stream is None:
                    stream.codec_stream = self.pool.open()
            stacked = [torch.stack(frames) for _, frames in with_frames]
            codes = [f[:, 1:].t().contiguous().to(self.codec.device) for f in stacked]
            audio = self.pool.step([s.codec_stream for s, _ in with_frames], codes)
            for (stream, _), samples, frames in zip(with_frames, audio, stacked, strict=True):
                stream.emitted = True
                stream.on_audio(samples.float().cpu().numpy(), frames.numpy())
        for stream, _, done in work:
            if done is not None:
                if stream.codec_stream is not None:
                    stream.codec_stream.close()
                    stream.codec_stream = None
                done()

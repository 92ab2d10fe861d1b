"""Batched streaming codec decode across requests, on its own thread.

The engine thread pushes each request's new frames; the vocoder thread decodes, in one
`CodecStreamPool.step`, the frames that `ChunkPolicy` says are due, and hands the audio to
each stream's callback. The reference hands the codec every frame of a text batch but the last
(the `<|im_end|>` frame, or the final one at max length). The engine knows which frame is the
last when it delivers it (the frame comes with its finish reason), so `push(..., last=True)`
drops it and every other frame is released at once. (Before, each stream held back its latest
frame until the next one existed, which cost the first audio one decode step: about 4 ms of
the 34 ms measured in docs/performance.md run 45.)

On CUDA the pool's CUDA graphs are captured once (`capture_graphs`, called by the engine
before it sizes its KV pool) for batch buckets 1, 2, 4, .. `max_batch` and the chunk lengths
of `ChunkPolicy.graph_chunk_sizes` (the first chunk, then each size a stream's chunks grow
through); the policy then feeds the pool only chunks that fit
a captured shape (a stream's first chunk and the tail of a text batch pad up to one), and at
most `max_batch` streams per call. On the CPU nothing is captured and a ready stream's whole
backlog is decoded at once.

On CUDA the codec runs on its own high-priority stream. On the default stream, which the engine's
decode steps also use, a codec call queued behind the steps launched before it and its read-back
behind those launched meanwhile: the first audio chunk took 27-38 ms for a 2.7 ms graph
(docs/performance.md run 44). On its own stream its kernels go first whenever both are ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from shoal.engine.playback import PlaybackClock
from shoal.engine.stalls import StallWatch

log = logging.getLogger("shoal.engine.vocoder")

AudioCallback = Callable[[np.ndarray, np.ndarray], None]  # (samples float32 [n], frames int32 [f, N+1])
DoneCallback = Callable[[], None]
ErrorCallback = Callable[[BaseException], None]


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Batch buckets to capture: powers of two below `max_batch`, then `max_batch`."""
    sizes, size = {max_batch}, 1
    while size < max_batch:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


class StreamState(NamedTuple):
    """What `ChunkPolicy.plan` knows of one stream."""

    pending: int  # frames released and not yet decoded
    chunks_done: int
    ending: bool  # its text batch has ended: the tail is flushed
    clock: PlaybackClock | None = None  # the listener's playback
    first_chunk: int | None = None  # its first chunk's length (latency mode); None: the policy's


@dataclass(frozen=True)
class ChunkPolicy:
    """How many of a stream's released frames to decode now (pure; the vocoder applies it).

    A stream's first chunk is `first_chunk_frames` long, so the first audio stays prompt; its
    next is `chunk_frames`, and each after that twice the one before, up to `max_chunk_frames`
    (None: `chunk_frames`, no growth). Growing chunks cost the listener nothing once audio is
    ahead of playback (each chunk's audio lasts longer than the next one takes to generate while
    the stream runs at least twice as fast as real time), and they make the codec cheaper per
    frame: a call's cost is mostly per stream, not per frame (docs/performance.md runs 4-5:
    64 streams x 4 frames 15.7 ms, x 8 frames 20.4 ms).

    A stream is due once it holds its next chunk, as soon as its text batch has ended (the
    tail is flushed), or once its listener has less than `refill_seconds` of audio buffered: it
    then gives what it holds (a captured length, at least the first chunk's), so the listener is
    fed whenever generation runs faster than playback. Without that, a chunk longer than the one
    before it needs generation faster than real time by their ratio (4 then 8 frames: 2x, plus
    the codec call) to arrive before the audio before it has played out.

    Without captured graphs (`graph_chunks` empty) a due stream's whole backlog is taken. With
    graphs a due stream gives the largest captured chunk that it fills, up to `max_chunk_frames`,
    and an ending stream its tail up to the largest captured chunk (the pool pads it up to the next
    captured length); the rest waits for the next call. At most `max_batch` streams are taken per
    call: streams whose first audio is waiting first, then the least buffered."""

    chunk_frames: int = 8
    first_chunk_frames: int = 4
    graph_chunks: tuple[int, ...] = ()  # captured chunk lengths, ascending
    max_batch: int | None = None  # streams per codec call; None: unbounded
    max_chunk_frames: int | None = None  # the largest chunk after growth; None: chunk_frames
    refill_seconds: float = 0.0  # a stream with less audio buffered is due early; 0: never

    def __post_init__(self) -> None:
        if self.chunk_frames < 1 or self.first_chunk_frames < 1:
            raise ValueError("chunk sizes must be >= 1")
        if self.refill_seconds < 0:
            raise ValueError("refill_seconds must be >= 0")
        if self.max_chunk_frames is not None and self.max_chunk_frames < self.chunk_frames:
            raise ValueError("max_chunk_frames must be at least chunk_frames")
        if list(self.graph_chunks) != sorted(set(self.graph_chunks)) or any(c < 1 for c in self.graph_chunks):
            raise ValueError("graph_chunks must be ascending, distinct and >= 1")

    @property
    def largest_chunk(self) -> int:
        return self.max_chunk_frames or self.chunk_frames

    def chunk_size(self, chunks_done: int, first: int | None = None) -> int:
        """The length of a stream's next chunk after `chunks_done` chunks (`first`: its own
        first chunk's length, by its latency mode; None: `first_chunk_frames`)."""
        if chunks_done <= 0:
            return self.first_chunk_frames if first is None else first
        return min(self.largest_chunk, self.chunk_frames << min(chunks_done - 1, 30))

    @staticmethod
    def graph_chunk_sizes(
        chunk_frames: int,
        first_chunk_frames: int,
        max_chunk_frames: int | None = None,
        other_first_chunks: tuple[int, ...] = (),
    ) -> tuple[int, ...]:
        """The chunk lengths worth capturing: the first chunks (of every latency mode) and each
        size of the growth."""
        sizes, size = {first_chunk_frames, chunk_frames, *other_first_chunks}, chunk_frames
        largest = max_chunk_frames or chunk_frames
        while size < largest:
            sizes.add(size)
            size *= 2
        sizes.add(largest)
        return tuple(sorted(sizes))

    def take(self, pending: int, chunks_done: int, ending: bool, first: int | None = None) -> int:
        """Frames to decode now from `pending` released frames (0: keep holding them)."""
        need = self.chunk_size(chunks_done, first)
        if pending <= 0 or (pending < need and not ending):
            return 0
        if not self.graph_chunks:
            return pending
        limit = min(pending, self.graph_chunks[-1])
        if ending:
            return limit
        limit = min(limit, max(need, self.largest_chunk))
        return max((c for c in self.graph_chunks if c <= limit), default=limit)

    def refill(self, pending: int) -> int:
        """Frames to decode now for a stream whose listener runs low: what it holds, as the
        largest captured length that fits (none below the first chunk's length)."""
        if pending < self.first_chunk_frames:
            return 0
        if not self.graph_chunks:
            return pending
        fitting = (c for c in self.graph_chunks if self.first_chunk_frames <= c <= pending)
        return max(fitting, default=0)

    def first_chunks_apart(self, takes: Sequence[tuple[int, int]]) -> bool:
        """Whether a codec call of (frames, chunks done) per stream should decode its first
        chunks in a call of their own, before the rest: when the rest holds a chunk more than
        twice as long as they are. One call pads every row to its longest chunk, so a first
        chunk would cost, and wait for, a long one (with growing chunks: 32 frames; in run 49
        first audio at concurrency 8 rose from 57 / 72 to 72 / 123 ms p50 / p95). Below that
        ratio (the default 4 and 8) one call costs less than two."""
        firsts = [frames for frames, done in takes if done == 0]
        others = [frames for frames, done in takes if done > 0]
        return bool(firsts and others) and max(others) > 2 * max(firsts)

    def plan(self, streams: Sequence[StreamState], now: float | None = None) -> dict[int, int]:
        """One `StreamState` per stream -> {index: frames to take now}. When more are due than
        one call takes: first audio waiting first, then the streams whose listeners have the
        least audio buffered at `now`, then in order. Clocks are read only for streams that
        could refill early or must be ranked."""
        now = time.monotonic() if now is None else now
        headrooms: dict[int, float] = {}

        def headroom(index: int) -> float:
            if index not in headrooms:
                clock = streams[index].clock
                value = clock.headroom(now) if clock is not None else None
                headrooms[index] = math.inf if value is None else value
            return headrooms[index]

        due = []
        for index, (pending, chunks_done, ending, _, first) in enumerate(streams):
            count = self.take(pending, chunks_done, ending, first)
            if count == 0 and chunks_done > 0 and self.refill_seconds > 0 and pending > 0:
                if headroom(index) < self.refill_seconds:
                    count = self.refill(pending)
            if count > 0:
                due.append((index, count))
        if self.max_batch is not None and len(due) > self.max_batch:
            due.sort(key=lambda item: (streams[item[0]].chunks_done > 0, headroom(item[0])))  # stable
            due = due[: self.max_batch]
        return dict(due)


class VocoderStream:
    """One text batch of one request: frames in, audio out."""

    def __init__(
        self,
        on_audio: AudioCallback,
        on_error: ErrorCallback | None = None,
        clock: PlaybackClock | None = None,
        first_chunk: int | None = None,
    ) -> None:
        self.on_audio = on_audio
        self.first_chunk = first_chunk  # its first chunk's length (its latency mode); None: the policy's
        self.on_error = on_error  # the decode of this stream's frames failed: it gets no more audio
        self.clock = clock  # the listener's playback: booked at each delivery, orders the calls
        self.pending: list[np.ndarray] = []  # frames released for decoding, int32 [N+1] each
        self.ending: DoneCallback | None = None  # set by end(): flush, then call it
        self.closed = False
        self.chunks = 0  # chunks decoded so far (their lengths follow `ChunkPolicy.chunk_size`)
        self.codec_stream = None


Work = list[tuple[VocoderStream, list[np.ndarray], DoneCallback | None]]


class Vocoder:
    def __init__(
        self,
        codec,
        max_streams: int,
        chunk_frames: int = 8,
        first_chunk_frames: int = 4,
        max_batch: int = 64,
        max_chunk_frames: int | None = None,
        refill_seconds: float = 0.0,
        low_latency_first_chunk_frames: int | None = None,
    ) -> None:
        self.codec = codec
        # latency "low": this first chunk (captured too); None: as "balanced"
        self.low_latency_first_chunk = low_latency_first_chunk_frames or first_chunk_frames
        self.max_streams = max_streams
        self.pool = codec.stream_pool(max_streams)
        self.call_stalls = StallWatch("a codec call")
        self.policy = ChunkPolicy(
            chunk_frames, first_chunk_frames, max_chunk_frames=max_chunk_frames, refill_seconds=refill_seconds
        )
        self.max_batch = max(1, min(max_batch, max_streams))
        self._streams: list[VocoderStream] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._deferring = False  # inside deferred_wakeups(): push and end wake the thread once
        self._wake_due = False
        on_gpu = codec.device.type == "cuda"
        # Negative: above the default priority (0) of the engine's stream (see the module docstring).
        self.cuda_stream = torch.cuda.Stream(codec.device, priority=-1) if on_gpu else None
        self.read_back = HostReadBack()

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    @property
    def chunk_frames(self) -> int:
        return self.policy.chunk_frames

    @property
    def first_chunk_frames(self) -> int:
        return self.policy.first_chunk_frames

    def first_chunk_for(self, latency: str) -> int:
        """A stream's first chunk by its request's latency mode (`api.LATENCY_MODES`): "low" the
        smallest, "balanced" the policy's first chunk, "normal" a full chunk."""
        if latency == "low":
            return self.low_latency_first_chunk
        if latency == "balanced":
            return self.policy.first_chunk_frames
        return self.policy.chunk_frames

    def capture_graphs(self) -> bool:
        """On CUDA: capture the pool's graphs for the policy's shapes and switch the policy to
        them. Call before the vocoder thread starts (capture must not race other GPU work).
        Returns whether graphs were captured."""
        if self.codec.device.type != "cuda" or self.policy.graph_chunks:
            return bool(self.policy.graph_chunks)
        policy = self.policy
        chunks = ChunkPolicy.graph_chunk_sizes(
            policy.chunk_frames,
            policy.first_chunk_frames,
            policy.max_chunk_frames,
            (self.low_latency_first_chunk,),
        )
        self.pool.capture_cuda_graphs(list(graph_batch_sizes(self.max_batch)), list(chunks))
        self.policy = dataclasses.replace(policy, graph_chunks=chunks, max_batch=self.max_batch)
        return True

    # Engine thread -------------------------------------------------------------------------

    def open(
        self,
        on_audio: AudioCallback,
        on_error: ErrorCallback | None = None,
        clock: PlaybackClock | None = None,
        first_chunk: int | None = None,
    ) -> VocoderStream:
        """A new stream; `clock` (shared by a request's text batches) books its audio as delivered;
        `first_chunk`: its first chunk's length (`first_chunk_for`; None: the policy's)."""
        stream = VocoderStream(on_audio, on_error, clock, first_chunk)
        with self._wake:
            self._streams.append(stream)
        return stream

    def push(self, stream: VocoderStream, frames: torch.Tensor | np.ndarray, last: bool = False) -> None:
        """New frames int32 [n, N+1] of the stream, in order. `last`: the final one is the text
        batch's last frame, which the reference never decodes: it is dropped. The frames are
        copied once, into numpy (no torch op per frame on the engine thread)."""
        if isinstance(frames, torch.Tensor):
            frames = frames.numpy()
        released = np.array(frames[:-1] if last else frames, dtype=np.int32)
        with self._wake:
            stream.pending.extend(released)
            self._notify_locked()

    def end(self, stream: VocoderStream, done: DoneCallback, drop: bool = False) -> None:
        """The batch is over: what is pending is decoded, then `done` runs on the vocoder thread.
        `drop`: discard what is pending instead (aborted or failed)."""
        with self._wake:
            if drop:
                stream.pending.clear()
            stream.ending = done
            self._notify_locked()

    @contextlib.contextmanager
    def deferred_wakeups(self) -> Iterator[None]:
        """Pushes and ends inside wake the vocoder thread once, on leaving. The engine thread
        delivers a whole step's frames inside one: woken per frame, the vocoder thread ran
        `collect` over every stream for each of them and took the GIL from the engine thread
        each time (`scripts/probe_host_delivery.py`, 2-core CPU, 32 streams: 24 µs of
        engine-thread time per frame, 10 with one wake-up per step)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            with self._wake:
                if self._wake_due:
                    self._wake_due = False
                    self._wake.notify_all()

    def _notify_locked(self) -> None:
        if self._deferring:
            self._wake_due = True
        else:
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

    def collect(self) -> Work:
        """Take the frames due now (`policy.plan`) and the streams that are done, as
        (stream, frames, done callback or None); finished streams leave the list. Caller holds
        `_wake` (or owns the vocoder, as tests do)."""
        streams = [
            StreamState(len(s.pending), s.chunks, s.ending is not None, s.clock, s.first_chunk)
            for s in self._streams
        ]
        plan = self.policy.plan(streams)
        work: Work = []
        for index, stream in enumerate(self._streams):
            count = plan.get(index, 0)
            frames, stream.pending = stream.pending[:count], stream.pending[count:]
            done = stream.ending if stream.ending is not None and not stream.pending else None
            if frames or done is not None:
                work.append((stream, frames, done))
        for stream, _, done in work:
            if done is not None:
                self._streams.remove(stream)
        return work

    def _loop(self) -> None:
        while True:
            with self._wake:
                work: Work = []
                while not self._stopping and not (work := self.collect()):
                    self._wake.wait()
                if self._stopping:
                    return
            for call in self.calls(work):
                try:
                    self.decode(call)
                except Exception as error:  # one failed codec call must not end audio for everyone
                    log.exception("vocoder: decoding %d stream(s) failed", len(call))
                    self.fail(call, error)

    def calls(self, work: Work) -> list[Work]:
        """The codec calls for one collected batch: one, or the first chunks apart and first
        when `ChunkPolicy.first_chunks_apart` says so (a new stream's first audio then does not
        wait for a call of long chunks)."""
        takes = [(len(frames), stream.chunks) for stream, frames, _ in work if frames]
        if not self.policy.first_chunks_apart(takes):
            return [work]
        first = [item for item in work if item[1] and item[0].chunks == 0]
        return [first, [item for item in work if not (item[1] and item[0].chunks == 0)]]

    def fail(self, work: Work, error: BaseException) -> None:
        """The streams of a failed decode leave the vocoder (their codec state is suspect) and
        hear about it through `on_error`; the other streams carry on."""
        with self._wake:
            for stream, _, _ in work:
                if stream in self._streams:
                    self._streams.remove(stream)
        for stream, _, _ in work:
            if stream.codec_stream is not None:
                stream.codec_stream.close()
                stream.codec_stream = None
            if stream.on_error is not None:
                stream.on_error(error)

    def decode(self, work: Work) -> None:
        """Decode one batch of streams' frames in one codec call and deliver the audio."""
        on_stream = torch.cuda.stream(self.cuda_stream) if self.cuda_stream is not None else None
        with on_stream or contextlib.nullcontext():
            self._decode(work)

    def _decode(self, work: Work) -> None:
        with_frames = [(s, frames) for s, frames, _ in work if frames]
        if with_frames:
            for stream, _ in with_frames:
                if stream.codec_stream is None:
                    stream.codec_stream = self.pool.open()
            stacked = [np.stack(frames) for _, frames in with_frames]
            codes = [torch.from_numpy(f[:, 1:].T) for f in stacked]  # on the host: sent in one copy
            started = time.monotonic()
            audio = self.pool.step([s.codec_stream for s, _ in with_frames], codes)
            # One read-back for the whole call (on CUDA one copy and one sync, not one per stream).
            host = self.read_back(torch.cat([samples.float() for samples in audio]))
            pieces = np.split(host, np.cumsum([samples.shape[0] for samples in audio])[:-1])
            delivered = time.monotonic()
            self.call_stalls.observe(
                delivered - started,
                lambda: (
                    f"{len(with_frames)} streams, chunks of {sorted({len(f) for _, f in with_frames})} frames"
                ),
            )
            for (stream, _), samples, frames in zip(with_frames, pieces, stacked, strict=True):
                stream.chunks += 1
                if stream.clock is not None:
                    stream.clock.deliver(len(samples) / self.sample_rate, delivered)
                stream.on_audio(samples, frames)
        for stream, _, done in work:
            if done is not None:
                if stream.codec_stream is not None:
                    stream.codec_stream.close()
                    stream.codec_stream = None
                done()


class HostReadBack:
    """A codec call's audio to the host. From CUDA through one pinned staging buffer, reused by
    every call (grown to the next power of two when a call needs more), and a CUDA event on the
    current stream: only this thread waits, for this stream's work alone. (A plain `.cpu()`
    copies into pageable memory; under load in docs/performance.md run 48 the engine thread then
    spent half its time blocked in its own non-blocking uploads.) The result is copied out of the
    staging buffer into memory numpy owns, so audio that clients hold on to never keeps
    page-locked memory."""

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None

    def __call__(self, tensor: torch.Tensor) -> np.ndarray:
        if tensor.device.type != "cuda":
            return tensor.numpy()
        count = tensor.numel()
        staging = self._staging
        if staging is None or staging.dtype != tensor.dtype or staging.numel() < count:
            size = 1 << max(0, count - 1).bit_length()
            staging = self._staging = torch.empty(size, dtype=tensor.dtype, pin_memory=True)
        view = staging[:count].view(tensor.shape)
        view.copy_(tensor, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        copied.synchronize()
        return view.numpy().copy()


__all__ = ["ChunkPolicy", "HostReadBack", "StreamState", "Vocoder", "VocoderStream", "graph_batch_sizes"]

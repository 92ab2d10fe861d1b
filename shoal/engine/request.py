"""One generation inside the engine: its prompt, sampling settings and progress.

A request's token sequence is its prompt followed by the frames generated so far (a frame has
the prompt column layout `[main_id, c0 .. c{N-1}]`). The KV cache holds the first
`num_computed` columns; the columns after that are fed to the model by the next step. A decode
is just the case of one pending column, so prefill, chunked prefill, decode and resumption
after preemption are the same bookkeeping.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shoal.engine.api import FinishReason, Priority
from shoal.engine.playback import PlaybackClock
from shoal.models.prompt import voice_prefix_key


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, as the batched sampler takes them per row."""

    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    repetition_penalty: float = 1.1
    seed: int = 0


# Called on the engine thread with (request, new frames int32 [n, N+1] or None, finish reason or None).
FrameSink = Callable[["Request", torch.Tensor | None, FinishReason | None], None]

_arrival_counter = itertools.count()


class Request:
    """Mutable engine-side state of one prompt being generated."""

    def __init__(
        self,
        request_id: str,
        prompt: torch.Tensor,
        params: SamplingParams,
        *,
        max_new_frames: int,
        priority: Priority = Priority.STANDARD,
        prefix_len: int = 0,
        prefix_key: str | None = None,
        sink: FrameSink | None = None,
    ) -> None:
        """`prefix_len` leading prompt columns are the voice prefix, shared with other requests
        in the prefix cache under `prefix_key` (taken from those columns when not given, once
        here, never again at each admission)."""
        if prompt.dim() != 2 or prompt.shape[1] < 1:
            raise ValueError(f"prompt must be [N+1, T] with T >= 1, got {tuple(prompt.shape)}")
        if max_new_frames < 1:
            raise ValueError("max_new_frames must be >= 1")
        self.request_id = request_id
        self.prompt = prompt.to(torch.long).cpu()
        self.params = params
        self.max_new_frames = max_new_frames
        self.priority = priority
        self.prefix_len = min(prefix_len, self.prompt.shape[1])
        if prefix_key is None and self.prefix_len:
            prefix_key = voice_prefix_key(self.prompt[:, : self.prefix_len])
        self.prefix_key = prefix_key
        self.sink = sink
        self.arrival = next(_arrival_counter)  # FIFO order within a class
        self.arrival_time = time.monotonic()  # for aging
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.frames = torch.zeros(max_new_frames, self.prompt.shape[0], dtype=torch.int32)
        # The same memory as numpy: the engine thread books each frame through it (a torch
        # setitem per frame costs several µs and lets other threads take the GIL).
        self._frames_np = self.frames.numpy()
        self._prompt_len = self.prompt.shape[1]  # the prompt never changes
        self.num_frames = 0
        self.num_computed = 0  # leading columns whose KV is in the cache
        self.block_table: list[int] = []  # page ids, in position order
        self.num_shared_pages = 0  # leading pages borrowed from the prefix cache
        self.num_preemptions = 0
        self.first_frame_time: float | None = None
        # Realtime admission: the listener's playback (shared by a synthesis's text batches), and
        # whether waiting too long for capacity ends this request with `error` (a 503) instead.
        self.playback: PlaybackClock | None = None
        self.continuation = False  # a later text batch of a synthesis already admitted
        self.may_expire = priority is not Priority.BATCH
        self.error: Exception | None = None  # why it ended with FinishReason.ERROR, when known

    # Sequence view -------------------------------------------------------------------------

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    @property
    def num_rows(self) -> int:
        """N+1: the token row plus one row per codebook."""
        return self.prompt.shape[0]

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.num_frames

    @property
    def num_pending(self) -> int:
        """Columns not yet in the KV cache; 1 for a request in steady decoding."""
        return self.seq_len - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_frames > 0 and self.num_pending == 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def columns(self, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of prompt + generated frames, Long [N+1, end-start]."""
        if not 0 <= start <= end <= self.seq_len:
            raise IndexError(f"columns {start}:{end} outside sequence of {self.seq_len}")
        parts = []
        if start < self.prompt_len:
            parts.append(self.prompt[:, start : min(end, self.prompt_len)])
        if end > self.prompt_len:
            first = max(start, self.prompt_len) - self.prompt_len
            parts.append(self.frames[first : end - self.prompt_len].to(torch.long).t())
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def window(self, size: int) -> torch.Tensor:
        """The previous-frames window int32 [size, N+1] the sampler expects before the next
        frame: the last `size` frames of index >= 1 (frame 0, the prefill frame, never enters
        it; see models/sampling.py), oldest first, zero rows before them."""
        out = torch.zeros(size, self.num_rows, dtype=torch.int32)
        n = min(size, max(0, self.num_frames - 1))
        if n:
            out[size - n :] = self.frames[self.num_frames - n : self.num_frames]
        return out

    # Progress ------------------------------------------------------------------------------

    def append_frame(self, frame: np.ndarray | torch.Tensor) -> None:
        """Book the next frame, int32 [N+1] (numpy on the engine's hot path)."""
        if self.num_frames >= self.max_new_frames:
            raise RuntimeError(f"request {self.request_id} already has max_new_frames frames")
        self._frames_np[self.num_frames] = frame
        self.num_frames += 1
        if self.first_frame_time is None:
            self.first_frame_time = time.monotonic()

    def effective_priority(self, now: float, aging_seconds: float) -> int:
        """The class used for ordering: one class more urgent per `aging_seconds` waited."""
        if aging_seconds <= 0 or self.priority == Priority.REALTIME:
            return int(self.priority)
        boost = int((now - self.arrival_time) // aging_seconds)
        return max(int(Priority.STANDARD), int(self.priority) - boost)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.priority.name}, {self.status.value}, "
            f"prompt={self.prompt_len}, frames={self.num_frames}, computed={self.num_computed})"
        )

"""The threaded, asyncio-facing engine: `LocalEngine` runs an `EngineCore` (core.py) on its
own thread; the event loop queues requests and aborts and receives frames and audio through
the handles (handles.py).

The engine thread holds the state lock while it plans and launches a step and while it
delivers the step's frames, but not while the GPU computes: `submit`/`abort` wait for at
most the host part of a step.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Callable

import numpy as np
import torch

from shoal.config import EngineConfig
from shoal.engine.api import (
    Engine,
    EngineStats,
    FinishReason,
    InvalidRequest,
    Priority,
    RequestHandle,
    SynthesisRequest,
    VoiceReference,
)
from shoal.engine.core import EngineCore, new_request_id
from shoal.engine.handles import FrameStream, SynthesisHandle
from shoal.engine.request import SamplingParams
from shoal.engine.vocoder import Vocoder
from shoal.models.prompt import Reference, build_prompt, voice_prefix_length


class LocalEngine(Engine):
    """The Engine the server drives: an EngineCore on its own thread, plus the vocoder."""

    def __init__(self, model, config: EngineConfig, codec=None, model_name: str = "s2-pro") -> None:
        self.core = EngineCore(model, config)
        self.config = config
        self.codec = codec
        self.vocoder = None
        if codec is not None:
            streams = 2 * config.max_running_requests
            self.vocoder = Vocoder(
                codec, streams, config.vocoder_chunk_frames, config.vocoder_first_chunk_frames
            )
        self.sample_rate = codec.sample_rate if codec is not None else 44100
        self.frame_rate = self.sample_rate / (codec.frame_length if codec is not None else 2048)
        self.model_name = model_name
        self._handles: dict[str, SynthesisHandle] = {}
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.last_error: BaseException | None = None

    # Thread --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.start_thread()

    async def stop(self) -> None:
        self.stop_thread()

    def start_thread(self) -> None:
        if self.vocoder is not None:
            self.vocoder.start()
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
            self._thread.start()

    def stop_thread(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.vocoder is not None:
            self.vocoder.stop()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.core.has_work:
                    self._wake.wait()
                if self._stopping:
                    return
                pending = self._guarded(self.core.begin_step)
            if pending is None:
                continue
            try:
                pending.wait()  # the GPU computes; submit/abort may run meanwhile
            except Exception as error:
                with self._wake:
                    self._fail(error)
                continue
            with self._wake:
                self._guarded(self.core.end_step, pending)

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except Exception as error:  # fail what was running, keep serving the rest
            self._fail(error)
            return None

    def _fail(self, error: BaseException) -> None:
        self.last_error = error
        for request in list(self.core.scheduler.running):
            self.core.abort(request.request_id, FinishReason.ERROR)
        self.core.runner.host.invalidate()

    def call(self, fn: Callable, *args, **kwargs):
        """Run `fn` on the engine state between steps, then wake the loop."""
        with self._wake:
            result = fn(*args, **kwargs)
            self._wake.notify_all()
            return result

    # Engine API ----------------------------------------------------------------------------

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        if not request.text.strip():
            raise InvalidRequest("text is empty")
        request_id = request.request_id or new_request_id()
        if request_id in self._handles:
            raise InvalidRequest(f"duplicate request id {request_id}")
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        handle = SynthesisHandle(self, request, request_id, seed)
        try:
            first = handle.next_request()
        except ValueError as error:  # bad reference codes and the like
            raise InvalidRequest(str(error)) from error
        try:
            self.call(self.core.add, first)
        except Exception:
            if self.vocoder is not None:
                self.vocoder.end(handle._stream, lambda: None, drop=True)
            raise
        self._handles[request_id] = handle
        return handle

    def abort(self, request_id: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None and handle.current is not None:
            self.call(self.core.abort, handle.current.request_id)
        else:
            self.call(self.core.abort, request_id)

    async def prefill_voice(self, references: tuple[VoiceReference, ...], voice_key: str) -> None:
        model = self.core.model
        refs = tuple(Reference(r.text, torch.as_tensor(r.codes).long()) for r in references)
        prefix = build_prompt(model.config, model.tokenizer, "", refs)
        prefix = prefix[:, : voice_prefix_length(model.config, model.tokenizer, refs)]
        await asyncio.get_running_loop().run_in_executor(None, self.call, self.core.prefill_voice, prefix)

    async def encode_reference(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        if self.codec is None:
            raise InvalidRequest("this engine has no codec")

        def encode() -> np.ndarray:
            wave = torch.as_tensor(np.asarray(audio, dtype=np.float32)).flatten()
            if sample_rate != self.codec.sample_rate:
                size = max(1, round(wave.numel() * self.codec.sample_rate / sample_rate))
                wave = torch.nn.functional.interpolate(wave[None, None], size=size, mode="linear")[0, 0]
            return self.codec.encode(wave)[0].cpu().numpy()

        return await asyncio.get_running_loop().run_in_executor(None, encode)

    def stats(self) -> EngineStats:
        return self.call(self.core.stats)

    # Frame-level API (tests, benchmarks) ---------------------------------------------------

    def submit_frames(
        self,
        prompt: torch.Tensor,
        params: SamplingParams,
        *,
        max_new_frames: int,
        priority: Priority = Priority.STANDARD,
        prefix_len: int = 0,
        request_id: str | None = None,
    ) -> FrameStream:
        """Queue one prompt; iterate the returned stream for its frames (raises EngineOverloaded)."""
        stream = FrameStream(self, request_id or new_request_id(), asyncio.get_running_loop())
        request = self.core.new_request(
            prompt,
            params,
            max_new_frames=max_new_frames,
            priority=priority,
            prefix_len=prefix_len,
            request_id=stream.request_id,
            sink=stream.sink,
        )
        self.call(self.core.add, request)
        return stream


__all__ = ["EngineCore", "FrameStream", "LocalEngine", "SynthesisHandle", "new_request_id"]

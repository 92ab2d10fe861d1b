"""The threaded, asyncio-facing engine: `LocalEngine` runs an `EngineCore` (core.py) on its
own thread, and only that thread touches the engine state.

Callers (the event loop, executor threads) never wait for a step. `submit` and `abort` put a
command into a thread-safe inbox (`queue.SimpleQueue`) that the engine thread drains at every
step boundary, and blocks on while idle, so a command wakes it at once. `stats` reads a
snapshot the engine thread publishes at every boundary. Queue limits are checked in `submit`
against per-class counts (the published waiting counts plus the submitted requests not yet
drained, reserved under a lock held for a few instructions, never across a step), so
`EngineOverloaded` is still raised synchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from shoal.config import EngineConfig
from shoal.engine.api import (
    DEFAULT_FRAME_RATE,
    LATENCY_MODES,
    Engine,
    EngineOverloaded,
    EngineStats,
    FinishReason,
    InvalidRequest,
    Priority,
    RequestHandle,
    SynthesisRequest,
    VoiceReference,
)
from shoal.engine.core import EngineCore, new_request_id
from shoal.engine.gc_pauses import GcPauses
from shoal.engine.handles import EngineLink, FrameStream, SynthesisHandle
from shoal.engine.request import Request, SamplingParams
from shoal.engine.vocoder import Vocoder
from shoal.models.codec import AudioTooShortError
from shoal.models.prompt import V15_MAX_LENGTH, LongTextHistory, Reference, VoicePrompt, build_prompt

_STOP = object()

logger = logging.getLogger(__name__)

# Warm-up (`LocalEngine.warmup`): frames each synthetic request decodes, and the prefill budget
# it uses off CUDA, where nothing is compiled on first use and a long chunk would only cost time.
WARMUP_DECODE_FRAMES = 4
CPU_WARMUP_PREFILL_TOKENS = 64
# A voice must leave this many context positions to speak in (6 s of audio), else it is refused.
VOICE_MIN_SPEECH_FRAMES = 128


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What `LocalEngine.warmup` ran: prompt lengths, engine steps, frames per codec call."""

    seconds: float
    prompt_lengths: tuple[int, ...]
    prefill_tokens: int  # the prefill budget per step it ran with
    steps: int
    vocoder_chunks: tuple[int, ...]


def warmup_prompt_lengths(page_size: int, prefill_tokens: int, max_tokens: int) -> tuple[int, ...]:
    """Prompts the warm-up prefills at once: two short ones (their chunks and the long one's
    first fill one step of `prefill_tokens`, in which two requests complete) and one longer
    than the budget (a second, short chunk completes it). Token counts of the short chunks are
    neither 1 nor multiples of 16 (Triton specializes integer arguments on both). None above
    `max_tokens`; the long one is left out when it would not be longer than the short ones."""
    short = (page_size // 2 + 3, page_size + 5)
    lengths = [max(1, min(n, max_tokens)) for n in short]
    long = min(prefill_tokens + page_size // 2 + 1, max_tokens)
    if long > max(lengths):
        lengths.append(long)
    return tuple(lengths)


class Admission:
    """Waiting requests per class as `submit` sees them: the scheduler's waiting lists as of
    the engine thread's last snapshot, plus requests submitted but not yet drained from the
    inbox. The lock guards a few integer updates only."""

    def __init__(self, limits: Callable[[], dict[str, int]]) -> None:
        self._limits = limits
        self._lock = threading.Lock()
        self.waiting = {p: 0 for p in Priority}  # as of the last snapshot
        self.undrained = {p: 0 for p in Priority}
        self.stats: EngineStats | None = None

    def reserve(self, priority: Priority) -> None:
        """Count one more waiting request of `priority`, or raise EngineOverloaded."""
        name = priority.name.lower()
        limit = self._limits().get(name)
        with self._lock:
            if limit is not None and self.waiting[priority] + self.undrained[priority] >= limit:
                raise EngineOverloaded(f"{name} queue is full ({limit} waiting)")
            self.undrained[priority] += 1

    def release(self, priority: Priority) -> None:
        """Undo a reservation whose request never reached the inbox."""
        with self._lock:
            self.undrained[priority] -= 1

    def publish(self, stats: EngineStats, waiting: dict[Priority, int], drained: dict[Priority, int]) -> None:
        """Engine thread: the state after a boundary; `drained` requests moved from the inbox
        into the scheduler since the last call (and are counted in `waiting` now)."""
        with self._lock:
            self.stats = stats
            self.waiting = waiting
            for priority, count in drained.items():
                self.undrained[priority] -= count

    def snapshot(self) -> EngineStats:
        with self._lock:
            stats, undrained = self.stats, dict(self.undrained)
        waiting = {p.name.lower(): stats.waiting.get(p.name.lower(), 0) + undrained[p] for p in Priority}
        return dataclasses.replace(stats, waiting=waiting)


class LocalEngine(Engine):
    """The Engine the server drives: an EngineCore on its own thread, plus the vocoder."""

    def __init__(self, model, config: EngineConfig, codec=None, model_name: str = "s2-pro") -> None:
        self.config = config
        self.codec = codec
        self.vocoder = None
        if codec is not None:
            streams = 2 * config.max_running_requests
            self.vocoder = Vocoder(
                codec,
                streams,
                config.vocoder_chunk_frames,
                config.vocoder_first_chunk_frames,
                max_chunk_frames=config.vocoder_max_chunk_frames,
                # Paced by listeners where realtime admission protects them (not a CPU demo's).
                refill_seconds=config.vocoder_refill_seconds if config.resolved_realtime().enabled else 0.0,
                low_latency_first_chunk_frames=config.vocoder_low_latency_first_chunk_frames,
            )
            # Before the KV pool is sized from free memory, so the codec's graphs are counted.
            started = time.perf_counter()
            if config.use_cuda_graphs and self.vocoder.capture_graphs():
                torch.cuda.empty_cache()
                logger.info(
                    "codec graphs captured in %.1f s (chunks %s)",
                    time.perf_counter() - started, list(self.vocoder.policy.graph_chunks),
                )  # fmt: skip
        self.sample_rate = codec.sample_rate if codec is not None else 44100
        self.frame_rate = self.sample_rate / codec.frame_length if codec is not None else DEFAULT_FRAME_RATE
        started = time.perf_counter()
        self.core = EngineCore(model, config, self.frame_rate)
        logger.info(
            "engine core ready in %.1f s: %d KV pages of %d tokens, CUDA graphs %s",
            time.perf_counter() - started, self.core.kv.pool.num_pages, config.page_size,
            "on" if config.use_cuda_graphs and self.core.runner.device.type == "cuda" else "off",
        )  # fmt: skip
        self.model_name = model_name
        self.v15_max_length = V15_MAX_LENGTH  # 1.5 long text: `reference.generate_long`'s max_length
        self._handles: dict[str, SynthesisHandle] = {}
        self._link = EngineLink(
            self.sample_rate,
            self.vocoder,
            new_request=self.core.new_request,
            add_next_batch=lambda request: self.core.add(request, bypass_limit=True),
            abort=self.abort,
            handle_ended=lambda request_id: self._handles.pop(request_id, None),
            book_playback=self.core.book_playback,
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._admission = Admission(lambda: self.config.queue_limits)
        self.gc_pauses = GcPauses()  # counted while the engine runs (`start` to `stop`)
        self._drained = {p: 0 for p in Priority}
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None
        self.warmup_report: WarmupReport | None = None
        self._publish()

    # Warm-up -------------------------------------------------------------------------------

    def warmup(self) -> WarmupReport:
        """Before `start`: run synthetic requests through the whole path once, so that first-use
        costs (Triton compilation of the prefill and sampling kernels at the shapes the scheduler
        makes, first replays of the decode graphs, the codec's first-chunk and full-chunk steps)
        are paid now rather than by the first clients. Three prompts (`warmup_prompt_lengths`)
        are prefilled together, in chunks of the scheduler's `max_prefill_tokens` (on the CPU at
        most `CPU_WARMUP_PREFILL_TOKENS`), and decode `WARMUP_DECODE_FRAMES` frames each past
        `<|im_end|>`; a vocoder stream decodes a first chunk, a full chunk and its end.

        Leaves no trace: every page is freed (the prompts have no voice prefix, so the prefix
        cache is not touched), the step counters and rates are reset, the host batch is
        forgotten, and the global RNG states are restored (sampling itself is counter-based),
        so later requests give the frames they would have given without it."""
        if self._thread is not None or (self.vocoder is not None and self.vocoder._thread is not None):
            raise RuntimeError("warmup() must run before the engine is started")
        core = self.core
        if core.has_work or core.requests or core.kv.pool.num_used != core.kv.prefix_cache_pages:
            raise RuntimeError("warmup() needs an idle engine")
        start = time.perf_counter()
        on_gpu = core.runner.device.type == "cuda"
        prefill_tokens = self.config.max_prefill_tokens
        if not on_gpu:
            prefill_tokens = min(prefill_tokens, CPU_WARMUP_PREFILL_TOKENS)
        lengths = self._warmup_lengths(prefill_tokens)
        used_before, prefixes_before = core.kv.pool.num_used, core.kv.prefix_cache_pages
        config, scheduler_config = core.config, core.scheduler.config
        # On the CPU one intra-op thread: the ops are tiny, and on a small shared machine a
        # second thread made this take 0.1-4 s instead of 0.1 s (waiting for it to be scheduled).
        threads = torch.get_num_threads()
        with torch.random.fork_rng(devices=[core.runner.device] if on_gpu else []):
            warm_config = dataclasses.replace(config, max_prefill_tokens=prefill_tokens, ignore_eos=True)
            core.config = core.scheduler.config = warm_config
            if not on_gpu:
                torch.set_num_threads(1)
            try:
                steps = self._warmup_requests(lengths)
                chunks = self._warmup_vocoder()
            finally:
                core.config, core.scheduler.config = config, scheduler_config
                torch.set_num_threads(threads)
            if on_gpu:
                torch.cuda.synchronize(core.runner.device)
        if core.has_work or core.requests or core.kv.pool.num_used != used_before:
            raise RuntimeError("warm-up left work or pages behind")
        if core.kv.prefix_cache_pages != prefixes_before:
            raise RuntimeError("warm-up changed the prefix cache")
        core.steps = core.frames_out = core.steps_ahead = core.rows_discarded = 0
        core._rate_window.clear()
        core.scheduler.gate.forget()  # its steps compiled kernels: not what serving will cost
        core.runner.host.reset()  # no rows on the device: the next fill sends everything
        self._publish()
        report = WarmupReport(time.perf_counter() - start, lengths, prefill_tokens, steps, chunks)
        self.warmup_report = report
        logger.info(
            "warm-up took %.2f s: prompts of %s tokens (prefill budget %d), %d steps, codec chunks %s",
            report.seconds, list(lengths), prefill_tokens, steps, list(chunks),
        )  # fmt: skip
        return report

    def _warmup_lengths(self, prefill_tokens: int) -> tuple[int, ...]:
        """`warmup_prompt_lengths` within the context and so that all three fit the pool together."""
        core, page = self.core, self.config.page_size
        frames = WARMUP_DECODE_FRAMES
        lengths = warmup_prompt_lengths(page, prefill_tokens, core.max_seq_len - frames - 1)
        short_pages = sum(core.kv.pages_for(n + frames) for n in lengths[:2])
        room = (core.kv.pool.num_free - short_pages - 1) * page - frames
        if len(lengths) == 3 and lengths[2] > room:
            lengths = lengths[:2] if room <= max(lengths[:2]) else (*lengths[:2], room)
        return lengths

    def _warmup_requests(self, lengths: tuple[int, ...]) -> int:
        """Prefill and decode synthetic prompts of `lengths` tokens; returns the steps taken."""
        core = self.core
        model = core.model
        text = build_prompt(model.config, model.tokenizer, "Warm-up.", ())
        for index, length in enumerate(lengths):
            prompt = text.repeat(1, -(-length // text.shape[1]))[:, :length]
            params = SamplingParams(seed=index)
            core.add(
                core.new_request(
                    prompt, params, max_new_frames=WARMUP_DECODE_FRAMES, request_id=f"warmup-{index}"
                ),
                bypass_limit=True,
            )
        steps = 0
        try:
            while core.has_work:
                core.step()
                steps += 1
        except BaseException:  # leave no warm-up request holding pages behind the error
            core.discard_inflight()
            for index in range(len(lengths)):
                core.abort(f"warmup-{index}", FinishReason.ERROR)
            raise
        return steps

    def _warmup_vocoder(self) -> tuple[int, ...]:
        """One stream through the vocoder on this thread: a first chunk, a full chunk, the end
        (its held frame dropped). Returns the frames of each codec call."""
        vocoder = self.vocoder
        if vocoder is None:
            return ()
        chunks: list[int] = []
        frame_length = vocoder.codec.frame_length
        stream = vocoder.open(lambda samples, frames: chunks.append(len(samples) // frame_length))
        done: list[bool] = []
        rows = self.core.runner.num_rows
        first, full = vocoder.first_chunk_frames, vocoder.chunk_frames
        for count, end in ((first, False), (full + 1, True)):  # +1: the last frame, dropped
            vocoder.push(stream, torch.zeros(count, rows, dtype=torch.int32), last=end)
            if end:
                vocoder.end(stream, lambda: done.append(True))
            while work := vocoder.collect():
                vocoder.decode(work)
        if not done or vocoder._streams:
            raise RuntimeError("the vocoder warm-up stream did not finish")
        return tuple(chunks)

    # Thread --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.start_thread()

    async def stop(self) -> None:
        self.stop_thread()

    def start_thread(self) -> None:
        self.gc_pauses.install()
        if self.vocoder is not None:
            self.vocoder.start()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
            self._thread.start()

    def stop_thread(self) -> None:
        """Stop the threads; every request still queued, waiting or running ends (ABORTED),
        so no handle or stream is left waiting, and its pages are freed."""
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join()
            self._thread = None
        self.gc_pauses.uninstall()
        # No engine thread: this thread owns the state now. Apply what is left in the inbox
        # (commands posted after the stop, or before a start), then end everything.
        while not self._inbox.empty():
            self._drain(block=False)
        self.core.discard_inflight()
        for request_id in list(self.core.requests):
            self.core.abort(request_id)
        self._publish()
        if self.vocoder is not None:
            self.vocoder.stop()
        # Handles whose end the stopped vocoder never got to (their streams were dropped).
        for handle in list(self._handles.values()):
            handle.finished(FinishReason.ABORTED)

    def _loop(self) -> None:
        while True:
            self._publish()
            if not self._drain(block=not self.core.has_work):
                return
            pending = self._guarded(self.core.begin_step)
            self._publish()  # admissions; the GPU computes meanwhile
            if pending is None:
                continue
            try:
                pending.wait()
            except Exception as error:
                self._fail(error)
                continue
            # One wake-up of the vocoder thread for the step's frames.
            with self.vocoder.deferred_wakeups() if self.vocoder is not None else contextlib.nullcontext():
                self._guarded(self.core.end_step, pending)

    def _drain(self, block: bool) -> bool:
        """Apply the inbox's commands in order (waiting for the first one if `block`).
        Returns False when asked to stop."""
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while command is not _STOP:
            fn, args = command
            self._guarded(fn, *args)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _publish(self) -> None:
        waiting = {p: len(q) for p, q in self.core.scheduler.waiting.items()}
        self._admission.publish(self.core.stats(), waiting, self._drained)
        self._drained = {p: 0 for p in Priority}

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
        self.core.discard_inflight()  # a step launched ahead (overlap_steps) is not booked
        self.core.runner.host.invalidate()

    def _post(self, fn: Callable, *args) -> None:
        self._inbox.put((fn, args))

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the engine thread at the next step boundary; the returned
        future holds its result (run here at once when the thread is not running)."""
        future: Future = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as error:
                    future.set_exception(error)

        if self._thread is None or threading.current_thread() is self._thread:
            run()
        else:
            self._post(run)
        return future

    # Engine thread: the commands -----------------------------------------------------------

    def _add(self, request: Request) -> None:
        self._drained[request.priority] += 1
        try:
            self.core.add(request, bypass_limit=True)  # the limit was checked in submit
        except Exception as error:
            self.last_error = error
            if request.sink is not None:
                request.sink(request, None, FinishReason.ERROR)

    def _abort(self, request_id: str, handle: SynthesisHandle | None) -> None:
        if handle is not None and handle.current is not None:
            request_id = handle.current.request_id  # the text batch running now
        self.core.abort(request_id)

    # Engine API (any thread; never waits for the engine thread) ------------------------------

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        if not request.text.strip():
            raise InvalidRequest("text is empty")
        if request.latency not in LATENCY_MODES:
            modes = ", ".join(LATENCY_MODES)
            raise InvalidRequest(f"latency must be one of {modes}, got {request.latency!r}")
        request_id = request.request_id or new_request_id()
        if request_id in self._handles:
            raise InvalidRequest(f"duplicate request id {request_id}")
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        self._admission.reserve(request.priority)
        try:
            history = LongTextHistory(self._voice_prompt(request.references), self.v15_max_length)
            handle = SynthesisHandle(self._link, request, request_id, seed, history)
            first = handle.next_request()
        except ValueError as error:  # bad reference codes and the like
            self._admission.release(request.priority)
            raise InvalidRequest(str(error)) from error
        except BaseException:
            self._admission.release(request.priority)
            raise
        self._handles[request_id] = handle
        self._post(self._add, first)
        return handle

    def abort(self, request_id: str) -> None:
        """Queue the abort; the engine thread frees the request's pages at its next step
        boundary (at once when idle)."""
        handle = self._handles.get(request_id)  # it leaves `_handles` when it has ended
        if handle is not None:
            handle.aborted = True  # no further text batch starts
        self._post(self._abort, request_id, handle)

    def _voice_prompt(self, references: tuple[VoiceReference, ...]) -> VoicePrompt:
        """The voice's prompts: its prefix tokenized once, here (ValueError for bad codes)."""
        model = self.core.model
        refs = tuple(Reference(r.text, torch.as_tensor(r.codes).long()) for r in references)
        return VoicePrompt(model.config, model.tokenizer, refs)

    async def prefill_voice(self, references: tuple[VoiceReference, ...]) -> None:
        voice = self._voice_prompt(references)
        await asyncio.wrap_future(self.call(self.core.prefill_voice, voice.prefix, voice.key))

    def check_voice(self, references: tuple[VoiceReference, ...]) -> None:
        try:
            voice = self._voice_prompt(references)
            self.core.check_values(voice.prefix)
        except ValueError as error:  # codes of the wrong shape for this model
            raise InvalidRequest(f"reference audio: {error}") from error
        prefix = voice.prefix.shape[1]
        room = self.core.max_seq_len - prefix
        if room < VOICE_MIN_SPEECH_FRAMES:
            raise InvalidRequest(
                f"the voice's references take {prefix} of the model's {self.core.max_seq_len} context "
                f"positions, leaving {max(room, 0)} (at least {VOICE_MIN_SPEECH_FRAMES} are needed to "
                "speak): use shorter or fewer clips"
            )

    async def encode_reference(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        if self.codec is None:
            raise InvalidRequest("this engine has no codec")

        def encode() -> np.ndarray:
            wave = torch.as_tensor(np.asarray(audio, dtype=np.float32)).flatten()
            if sample_rate != self.codec.sample_rate:
                size = max(1, round(wave.numel() * self.codec.sample_rate / sample_rate))
                wave = torch.nn.functional.interpolate(wave[None, None], size=size, mode="linear")[0, 0]
            try:
                return self.codec.encode(wave)[0].cpu().numpy()
            except AudioTooShortError as error:
                raise InvalidRequest(f"reference audio: {error}") from error

        return await asyncio.get_running_loop().run_in_executor(None, encode)

    def stats(self) -> EngineStats:
        """The engine thread's last snapshot (at most one step old), submitted requests not
        yet drained counted as waiting, with the playback totals as they are now: streams end
        on the vocoder's thread, often after the engine's last step, when no snapshot follows."""
        core = self.core
        return dataclasses.replace(
            self._admission.snapshot(),
            streams_underrun=core.streams_underrun,
            underrun_seconds=core.underrun_seconds,
            first_audio_sum=core.first_audio_seconds,
            first_audio_count=core.first_audio_streams,
            gc_pause_seconds=self.gc_pauses.seconds,
            gc_longest_pause_seconds=self.gc_pauses.longest,
        )

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
        stream = FrameStream(self._link, request_id or new_request_id(), asyncio.get_running_loop())
        request = self.core.new_request(
            prompt,
            params,
            max_new_frames=max_new_frames,
            priority=priority,
            prefix_len=prefix_len,
            request_id=stream.request_id,
            sink=stream.sink,
        )
        self._admission.reserve(priority)
        self._post(self._add, request)
        return stream


__all__ = [
    "Admission",
    "EngineCore",
    "FrameStream",
    "LocalEngine",
    "SynthesisHandle",
    "WarmupReport",
    "new_request_id",
    "warmup_prompt_lengths",
]

"""`RemoteEngine`: the `Engine` of an API process whose engine runs in another process
(`shoal.engine.process`), reached over a ZeroMQ DEALER socket with the messages listed there.

One receive task hands each message to its request's queue or its call's future. One heartbeat
task pings every `ping_interval` seconds; each pong brings a stats snapshot (what `stats()`
returns, from any thread), the engine's epoch and the ids of this client's requests it still
runs. The engine counts as unavailable when no pong came for `unavailable_after` seconds: every
request in flight then fails with `EngineUnavailable` (the server answers 503), and so does
every submit until a pong comes again. A pong with a new epoch (the engine process restarted)
fails the requests sent to the old one; a pong that no longer lists a request sent before its
ping (the engine dropped it) fails that one. So no handle ever waits for audio that will not
come.

No torch here: an API process imports this without the model stack.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from typing import Any

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shoal.engine import wire
from shoal.engine.api import (
    DEFAULT_FRAME_RATE,
    AudioChunk,
    Engine,
    EngineStats,
    EngineUnavailable,
    FinishReason,
    InvalidRequest,
    QueuedHandle,
    RequestHandle,
    SynthesisRequest,
    VoiceReference,
)

log = logging.getLogger("shoal.engine.remote")

DEFAULT_PING_INTERVAL = 0.5
DEFAULT_UNAVAILABLE_AFTER = 3.0
DEFAULT_CALL_TIMEOUT = 60.0  # prefill_voice waits for a step boundary of a busy engine
CLOSE_LINGER_MS = 200  # time `stop`'s goodbye gets to leave


# What the engine's errors come back as on this side.
ERROR_KINDS: dict[str, type[Exception]] = {**wire.ERROR_KINDS, EngineUnavailable.__name__: EngineUnavailable}


class RemoteHandle(QueuedHandle):
    """A request running in the engine process; its messages arrive through the receive task.
    Iterating raises what failed it: EngineOverloaded, InvalidRequest and the like before the
    first chunk, EngineUnavailable at any point."""

    def __init__(
        self, engine: RemoteEngine, request_id: str, epoch: str | None, sent_after_ping: int
    ) -> None:
        super().__init__()
        self.request_id = request_id
        self.epoch = epoch  # of the engine it was sent to
        self.sent_after_ping = sent_after_ping  # pongs to later pings must list it while it runs
        self._engine = engine

    def deliver(self, item: AudioChunk | FinishReason | BaseException) -> None:
        self._queue.put_nowait(item)

    async def aclose(self) -> None:
        if self._finish is None:
            self._finish = FinishReason.ABORTED
            self._engine.abort(self.request_id)


class RemoteEngine(Engine):
    """The Engine API over the wire. Like LocalEngine, `submit` and the handles belong to the
    event loop that called `start`; `stats`, `check_voice` and `abort` may be called from any
    thread."""

    def __init__(
        self,
        address: str,
        *,
        ping_interval: float = DEFAULT_PING_INTERVAL,
        unavailable_after: float = DEFAULT_UNAVAILABLE_AFTER,
        start_timeout: float = 60.0,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        require_engine_at_start: bool = True,
    ) -> None:
        """`require_engine_at_start=False`: `start` returns once it waited `start_timeout` for
        the engine even if none answered (an API process started while the engine restarts
        serves 503s until it is back, rather than failing its start)."""
        self.address = address
        self.ping_interval = ping_interval
        self.unavailable_after = unavailable_after
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self.require_engine_at_start = require_engine_at_start
        # Known from the engine's first pong.
        self.sample_rate = 44100
        self.frame_rate = DEFAULT_FRAME_RATE
        self.model_name = ""
        self.epoch: str | None = None
        self.pid: int | None = None  # the engine process's
        self.restarts = 0  # engine process restarts seen (new epochs)
        self.available = False
        self.client_id = secrets.token_hex(6)
        self._request_ids = itertools.count()
        self._call_ids = itertools.count()
        self._handles: dict[str, RemoteHandle] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._stats: EngineStats | None = None
        self._pings_sent = 0
        self._last_pong = 0.0
        self._available_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._sync_lock = threading.Lock()
        self._sync_context: zmq.Context | None = None
        self._sync_socket: zmq.Socket | None = None

    # Lifetime --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and wait until the engine answers (EngineUnavailable after `start_timeout`,
        unless `require_engine_at_start` is off)."""
        if self._socket is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._available_event = asyncio.Event()
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.ROUTING_ID, f"shoal-{self.client_id}".encode())
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)  # audio is never dropped on the way in
        socket.setsockopt(zmq.LINGER, 0)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        socket.connect(self.address)
        self._socket = socket
        self._last_pong = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._receive()),
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._watch_connection(monitor)),
        ]
        if not await self.wait_available(self.start_timeout):
            message = f"no engine answered at {self.address} within {self.start_timeout:.0f} s"
            if not self.require_engine_at_start:
                log.warning("%s: requests get 503 until it does", message)
                return
            await self.stop()
            raise EngineUnavailable(message)

    async def wait_available(self, timeout: float) -> bool:
        """Wait until the engine answers pings (after a restart, too); False on timeout."""
        assert self._available_event is not None, "start() first"
        try:
            await asyncio.wait_for(self._available_event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Say goodbye (the engine aborts this client's requests), end every handle, close."""
        socket = self._socket
        if socket is None:
            return
        self._send({"type": "bye"})
        # Stop the monitor while its receiving end is still open: ZeroMQ's I/O thread sends each
        # event with a blocking send under the lock disable_monitor takes, so an event sent to a
        # receiver already closed would block both for good.
        socket.disable_monitor()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for handle in list(self._handles.values()):
            handle.deliver(FinishReason.ABORTED)
        self._handles.clear()
        self._fail_calls(EngineUnavailable("the client stopped"))
        self.available = False
        self._socket = None
        socket.close(linger=CLOSE_LINGER_MS)
        context, self._context = self._context, None
        if context is not None:
            await asyncio.to_thread(context.term)  # waits out the linger, off the loop
        with self._sync_lock:
            if self._sync_socket is not None:
                self._sync_socket.close(linger=0)
                self._sync_socket = None
            if self._sync_context is not None:
                self._sync_context.term()
                self._sync_context = None

    # Messages --------------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        """Send from the loop's thread (queued, never waited for: no high-water mark)."""
        socket = self._socket
        if socket is None:
            return
        future = socket.send(wire.pack(message))
        if future.done() and not future.cancelled() and future.exception() is not None:
            log.error("sending to the engine failed: %s", future.exception())

    async def _receive(self) -> None:
        assert self._socket is not None
        while True:
            payload = await self._socket.recv()
            try:
                self._dispatch(wire.unpack(payload))
            except Exception as error:  # a bad message never stops the client
                log.warning("ignored a message from the engine: %s", error)

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "audio":
            handle = self._handles.get(message["id"])
            if handle is not None:  # else aborted or failed here already
                handle.deliver(wire.decode_chunk(message["chunk"]))
        elif kind == "finish":
            handle = self._handles.pop(message["id"], None)
            if handle is not None:
                handle.deliver(wire.decode_reason(message["reason"]) or FinishReason.ERROR)
        elif kind == "error":
            handle = self._handles.pop(message["id"], None)
            if handle is not None:
                handle.deliver(wire.decode_error(message["error"], ERROR_KINDS))
        elif kind == "reply":
            future = self._calls.pop(message["call"], None)
            if future is not None and not future.done():
                if "error" in message:
                    future.set_exception(wire.decode_error(message["error"], ERROR_KINDS))
                else:
                    future.set_result(message.get("result"))
        elif kind == "pong":
            self._on_pong(message)
        else:
            raise wire.ProtocolError(f"unknown message type {kind!r}")

    # Heartbeat -------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            self._pings_sent += 1
            self._send({"type": "ping", "seq": self._pings_sent})
            silent = time.monotonic() - self._last_pong
            if self.available and silent > self.unavailable_after:
                self._set_unavailable(f"the engine has not answered for {silent:.1f} s")
            await asyncio.sleep(self.ping_interval)

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        """A connection the engine's side closed (its process died) makes the engine unavailable
        at once, rather than after `unavailable_after` seconds without pongs; pongs make it
        available again once ZeroMQ has reconnected to the restarted process."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and self.available:
                    self._set_unavailable("the engine process closed its connection")
        finally:
            monitor.close(linger=0)

    def _on_pong(self, message: dict[str, Any]) -> None:
        self._last_pong = time.monotonic()
        epoch = message["epoch"]
        if self.epoch is not None and epoch != self.epoch:
            log.warning("the engine process restarted (epoch %s -> %s)", self.epoch, epoch)
            self.restarts += 1
            self._fail_handles(EngineUnavailable("the engine process restarted and lost this request"))
            self._fail_calls(EngineUnavailable("the engine process restarted"))
        self.epoch = epoch
        info = message.get("info") or {}
        self.sample_rate = info.get("sample_rate", self.sample_rate)
        self.frame_rate = info.get("frame_rate", self.frame_rate)
        self.model_name = info.get("model_name", self.model_name)
        self.pid = info.get("pid", self.pid)
        self._stats = wire.decode_stats(message["stats"])
        # Requests sent before this pong's ping that the engine no longer runs, and whose end has
        # not arrived (it would have: an engine sends to a client in order), were dropped there.
        seq, active = message.get("seq"), set(message.get("active") or ())
        if isinstance(seq, int):
            for request_id, handle in list(self._handles.items()):
                if handle.sent_after_ping < seq and request_id not in active:
                    self._handles.pop(request_id)
                    handle.deliver(EngineUnavailable("the engine no longer runs this request"))
        if not self.available:
            self.available = True
            assert self._available_event is not None
            self._available_event.set()
            log.info("engine at %s is available (epoch %s)", self.address, epoch)

    def _set_unavailable(self, why: str) -> None:
        log.error("engine at %s unavailable: %s", self.address, why)
        self.available = False
        assert self._available_event is not None
        self._available_event.clear()
        self._fail_handles(EngineUnavailable(why))
        self._fail_calls(EngineUnavailable(why))

    def _fail_handles(self, error: EngineUnavailable) -> None:
        """Fail every request in flight; abort each on the engine in case it still runs them."""
        handles, self._handles = self._handles, {}
        for request_id, handle in handles.items():
            self._send({"type": "abort", "id": request_id})
            handle.deliver(error)

    def _fail_calls(self, error: EngineUnavailable) -> None:
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    def _check_available(self) -> None:
        if not self.available:
            raise EngineUnavailable(f"the engine at {self.address} is not answering")

    # Engine API ------------------------------------------------------------------------------

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        """Send the request and return its handle at once. The engine's refusals
        (EngineOverloaded, InvalidRequest) are raised by the handle's first `__anext__`."""
        self._check_available()
        if not request.text.strip():
            raise InvalidRequest("text is empty")
        request_id = request.request_id or f"{self.client_id}-{next(self._request_ids)}"
        if request_id in self._handles:
            raise InvalidRequest(f"duplicate request id {request_id}")
        handle = RemoteHandle(self, request_id, self.epoch, self._pings_sent)
        self._handles[request_id] = handle
        self._send(
            {"type": "submit", "id": request_id, "epoch": self.epoch, "request": wire.encode_request(request)}
        )
        return handle

    def abort(self, request_id: str) -> None:
        """Tell the engine to abort the request (from any thread); its handle ends ABORTED."""
        loop = self._loop
        if loop is None:
            return

        def abort_here() -> None:
            handle = self._handles.pop(request_id, None)
            if handle is not None:
                handle.deliver(FinishReason.ABORTED)
            self._send({"type": "abort", "id": request_id})

        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            abort_here()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(abort_here)

    async def _call(self, method: str, *args: Any) -> Any:
        self._check_available()
        assert self._loop is not None
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._send({"type": "call", "call": call_id, "method": method, "args": list(args)})
        try:
            return await asyncio.wait_for(future, self.call_timeout)
        except TimeoutError:
            raise EngineUnavailable(
                f"the engine did not answer {method} within {self.call_timeout:.0f} s"
            ) from None
        finally:
            self._calls.pop(call_id, None)

    async def prefill_voice(self, references: tuple[VoiceReference, ...], *args: Any) -> None:
        """Forwards the arguments after the references as they are (the engine's signature)."""
        await self._call("prefill_voice", wire.encode_references(references), *args)

    async def encode_reference(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        samples = np.ascontiguousarray(audio, dtype=np.float32)
        return wire.decode_array(
            await self._call("encode_reference", wire.encode_array(samples), int(sample_rate))
        )

    async def refresh_stats(self) -> EngineStats:
        """The engine's stats now (`stats()` returns them from then on, until the next pong)."""
        self._stats = wire.decode_stats(await self._call("stats"))
        return self._stats

    def stats(self) -> EngineStats:
        """The last pong's snapshot (at most `ping_interval` old); any thread. Raises
        EngineUnavailable while the engine does not answer."""
        stats = self._stats
        if not self.available or stats is None:
            raise EngineUnavailable(f"the engine at {self.address} is not answering")
        return stats

    def check_voice(self, references: tuple[VoiceReference, ...]) -> None:
        """A blocking round trip (the server calls it from a worker thread) on a socket of its
        own: ZeroMQ sockets belong to one thread, and the loop's socket to the loop."""
        self._sync_call("check_voice", wire.encode_references(references))

    def _sync_call(self, method: str, *args: Any) -> Any:
        self._check_available()
        timeout = self.call_timeout
        with self._sync_lock:
            if self._sync_socket is None:
                self._sync_context = zmq.Context()
                self._sync_socket = self._sync_context.socket(zmq.DEALER)
                self._sync_socket.setsockopt(zmq.LINGER, 0)
                self._sync_socket.connect(self.address)
            socket = self._sync_socket
            call_id = next(self._call_ids)
            socket.send(wire.pack({"type": "call", "call": call_id, "method": method, "args": list(args)}))
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not socket.poll(int(remaining * 1000)):
                    raise EngineUnavailable(f"the engine did not answer {method} within {timeout:.0f} s")
                message = wire.unpack(socket.recv())
                if message["type"] == "reply" and message.get("call") == call_id:
                    break  # else a late reply to a call that timed out
        if "error" in message:
            raise wire.decode_error(message["error"], ERROR_KINDS)
        return message.get("result")


__all__ = ["ERROR_KINDS", "EngineUnavailable", "RemoteEngine", "RemoteHandle"]

"""The engine in a process of its own, served over ZeroMQ to the API processes.

One engine process per GPU runs the scheduler, the GPU loop and the vocoder with a GIL of its
own; API processes (`shoal.engine.remote.RemoteEngine`) talk to it over a ROUTER socket, as
vLLM V1 and sglang split theirs. Every message is one frame, a msgpack map (`wire.pack`):

client -> engine
  submit  {id, epoch, request}      run a SynthesisRequest; `epoch` must be this process's
  abort   {id}                      abort one of this client's requests
  call    {call, method, args}      prefill_voice | check_voice | encode_reference | stats | info
  ping    {seq}                     heartbeat, every ~0.5 s
  bye     {}                        the client is stopping: abort all of its requests
engine -> client
  audio   {id, chunk}               an AudioChunk (samples and frames as raw bytes)
  finish  {id, reason}              the request ended (a FinishReason value)
  error   {id, error}               the request failed ({kind, message}: the API exception)
  reply   {call, result | error}    a call's answer
  pong    {seq, epoch, stats, info, active}   `active`: this client's running request ids

`epoch` is a random id per engine process start: a client seeing a new one knows the engine
restarted and its in-flight requests are gone. A client whose messages stop for
`client_timeout` seconds, or whose connection is gone (the ROUTER cannot route to it any more),
has its requests aborted, so its KV pages are freed.

`engine_process_main` is the child's entry point (`python -m shoal.engine.process --spec JSON`);
`EngineSupervisor` starts it from a parent that never imports torch, waits until it answers
pings, restarts it when it dies and stops it on shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from shoal.engine import wire
from shoal.engine.api import Engine, EngineError, InvalidRequest, RequestHandle

log = logging.getLogger("shoal.engine.process")

# A client that sends nothing (its pings included) for this long is taken for gone.
DEFAULT_CLIENT_TIMEOUT = 5.0
REAP_INTERVAL = 0.25  # how often the engine looks for gone clients (and a gone parent)
SHUTDOWN_LINGER_MS = 1000  # time the last messages get to leave when the engine stops
# The kind of error that the client raises as `api.EngineUnavailable`.
UNAVAILABLE = "EngineUnavailable"


@dataclass
class ClientState:
    """What the engine knows of one connected client (one DEALER identity)."""

    last_seen: float
    streams: dict[str, asyncio.Task] = field(default_factory=dict)  # request id -> streaming task
    handles: dict[str, RequestHandle] = field(default_factory=dict)


class EngineServer:
    """The engine process's side of the wire: one ROUTER socket, one asyncio loop."""

    def __init__(
        self,
        engine: Engine,
        socket: zmq.asyncio.Socket,
        epoch: str,
        client_timeout: float = DEFAULT_CLIENT_TIMEOUT,
    ) -> None:
        self.engine = engine
        self.socket = socket
        self.epoch = epoch
        self.client_timeout = client_timeout
        self.clients: dict[bytes, ClientState] = {}
        # Every stream and call task, those of dropped clients too (they end once aborted).
        self._tasks: set[asyncio.Task] = set()

    # Sending ---------------------------------------------------------------------------------

    def send(self, identity: bytes, message: Mapping[str, Any]) -> None:
        """Queue `message` for one client without waiting (no high-water mark: never dropped).
        A client the ROUTER cannot route to any more has gone: its requests are aborted."""
        future = self.socket.send_multipart([identity, wire.pack(message)])
        if future.done():
            self._sent(identity, future)
        else:
            future.add_done_callback(lambda done: self._sent(identity, done))

    def _sent(self, identity: bytes, future: asyncio.Future) -> None:
        error = future.exception() if not future.cancelled() else None
        if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            self.drop_client(identity, "its connection is gone")
        elif error is not None:
            log.error("sending to a client failed: %s", error)

    # Clients ---------------------------------------------------------------------------------

    def drop_client(self, identity: bytes, why: str) -> None:
        """Forget a client and abort its requests (their pages are freed at the next step)."""
        client = self.clients.pop(identity, None)
        if client is None:
            return
        if client.streams:
            log.warning("aborting %d request(s) of a client: %s", len(client.streams), why)
        for request_id in client.streams:
            self.engine.abort(request_id)

    def reap(self, now: float) -> None:
        for identity, client in list(self.clients.items()):
            if now - client.last_seen > self.client_timeout:
                self.drop_client(identity, f"nothing heard from it for {now - client.last_seen:.1f} s")

    # Receiving -------------------------------------------------------------------------------

    def handle(self, identity: bytes, payload: bytes) -> None:
        """Apply one client message. Never waits: streams and calls run as tasks."""
        client = self.clients.get(identity)
        if client is None:
            client = self.clients[identity] = ClientState(time.monotonic())
        client.last_seen = time.monotonic()
        message = wire.unpack(payload)
        kind = message["type"]
        if kind == "ping":
            self.send(identity, self.pong(message.get("seq"), client))
        elif kind == "submit":
            self.submit(identity, client, message)
        elif kind == "abort":
            if message.get("id") in client.streams:
                self.engine.abort(message["id"])
        elif kind == "call":
            self._track(asyncio.create_task(self.call(identity, message)))
        elif kind == "bye":
            self.drop_client(identity, "it said goodbye")
        else:
            raise wire.ProtocolError(f"unknown message type {kind!r}")

    def pong(self, seq: Any, client: ClientState) -> dict[str, Any]:
        return {
            "type": "pong",
            "seq": seq,
            "epoch": self.epoch,
            "stats": wire.encode_stats(self.engine.stats()),
            "info": self.info(),
            "active": list(client.streams),
        }

    def info(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "sample_rate": engine.sample_rate,
            "frame_rate": engine.frame_rate,
            "model_name": engine.model_name,
            "epoch": self.epoch,
            "pid": os.getpid(),
        }

    def submit(self, identity: bytes, client: ClientState, message: dict[str, Any]) -> None:
        request_id = str(message["id"])

        def refuse(error: BaseException) -> None:
            self.send(identity, {"type": "error", "id": request_id, "error": wire.encode_error(error)})

        if message.get("epoch") != self.epoch:
            # Sent to an engine process that has died since: this one never promised to run it.
            refuse_unavailable = {"kind": UNAVAILABLE, "message": "the engine restarted before this request"}
            self.send(identity, {"type": "error", "id": request_id, "error": refuse_unavailable})
            return
        if request_id in client.streams:
            refuse(InvalidRequest(f"duplicate request id {request_id}"))
            return
        try:
            request = dataclasses.replace(wire.decode_request(message["request"]), request_id=request_id)
            handle = self.engine.submit(request)
        except Exception as error:  # EngineOverloaded, InvalidRequest, a malformed request
            refuse(error)
            return
        client.handles[request_id] = handle
        client.streams[request_id] = self._track(
            asyncio.create_task(self.stream(identity, client, request_id, handle))
        )

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stream(
        self, identity: bytes, client: ClientState, request_id: str, handle: RequestHandle
    ) -> None:
        """Forward one request's audio, then its finish (or the error that ended it)."""
        try:
            async for chunk in handle:
                self.send(identity, {"type": "audio", "id": request_id, "chunk": wire.encode_chunk(chunk)})
            ending = {"type": "finish", "id": request_id, "reason": wire.encode_reason(handle.finish_reason)}
        except asyncio.CancelledError:
            raise  # shutdown: the handle's own cleanup aborts the request
        except EngineError as error:  # an answer the client gets (503, 400), not a fault here
            log.debug("request %s ended: %s", request_id, error)
            ending = {"type": "error", "id": request_id, "error": wire.encode_error(error)}
        except Exception as error:
            log.exception("request %s failed while streaming", request_id)
            ending = {"type": "error", "id": request_id, "error": wire.encode_error(error)}
        finally:
            client.streams.pop(request_id, None)
            client.handles.pop(request_id, None)
        self.send(identity, ending)

    async def call(self, identity: bytes, message: dict[str, Any]) -> None:
        call_id = message.get("call")
        try:
            result = await self.run_call(str(message.get("method")), list(message.get("args") or ()))
            reply = {"type": "reply", "call": call_id, "result": result}
        except Exception as error:
            if not isinstance(error, EngineError):
                log.exception("call %s failed", message.get("method"))
            reply = {"type": "reply", "call": call_id, "error": wire.encode_error(error)}
        self.send(identity, reply)

    async def run_call(self, method: str, args: list[Any]) -> Any:
        engine = self.engine
        if method == "info":
            return self.info()
        if method == "stats":
            return wire.encode_stats(engine.stats())
        if method == "check_voice":
            # Builds prompts on the CPU: off the loop, as the server calls it off its own.
            await asyncio.to_thread(engine.check_voice, wire.decode_references(args[0]))
            return None
        if method == "prefill_voice":
            # The caller's arguments after the references, whatever this engine's signature.
            await engine.prefill_voice(wire.decode_references(args[0]), *args[1:])
            return None
        if method == "encode_reference":
            codes = await engine.encode_reference(wire.decode_array(args[0]), int(args[1]))
            return wire.encode_array(codes)
        raise wire.ProtocolError(f"unknown method {method!r}")

    # Lifetime --------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, parent_pid: int | None = None) -> None:
        """Serve until `stop` is set (or the parent process is gone); then every request still
        streaming fails on its client as unavailable and is aborted here."""
        receiver = asyncio.create_task(self._receive())
        reaper = asyncio.create_task(self._reap(stop, parent_pid))
        stopped = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait({receiver, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if receiver in done:
                receiver.result()  # the receive loop only ends by raising
        finally:
            for task in (receiver, reaper, stopped):
                task.cancel()
            await self.shut_down()

    async def _receive(self) -> None:
        while True:
            identity, payload = await self.socket.recv_multipart()
            try:
                self.handle(identity, payload)
            except Exception as error:  # a bad message never stops the engine
                log.warning("ignored a client message: %s", error)

    async def _reap(self, stop: asyncio.Event, parent_pid: int | None) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            self.reap(time.monotonic())
            if parent_pid is not None and os.getppid() != parent_pid:
                log.error("the supervising process %d is gone: stopping", parent_pid)
                stop.set()

    async def shut_down(self) -> None:
        unavailable = {"kind": UNAVAILABLE, "message": "the engine is shutting down"}
        clients = list(self.clients.items())  # a failed send drops its client from the dict
        for identity, client in clients:
            for request_id in list(client.streams):
                self.send(identity, {"type": "error", "id": request_id, "error": unavailable})
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()  # a stream's handle aborts its request as its iteration ends
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, client in clients:
            for handle in list(client.handles.values()):  # submitted, never iterated
                await handle.aclose()
        self.clients.clear()


def bound_socket(context: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    """The engine's ROUTER: unlimited queues (a slow client's audio is never dropped) and
    ROUTER_MANDATORY, so a send to a client that has gone fails and its requests are aborted."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client reconnecting under its id takes it over
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, SHUTDOWN_LINGER_MS)
    socket.bind(address)
    return socket


async def serve_engine(
    engine: Engine,
    address: str,
    *,
    stop: asyncio.Event | None = None,
    epoch: str | None = None,
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT,
    parent_pid: int | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve a started `engine` at `address` (ipc://path or tcp://host:port) until `stop` is
    set. Runs in the engine process's event loop: LocalEngine handles belong to it."""
    stop = stop or asyncio.Event()
    epoch = epoch or secrets.token_hex(8)
    context = zmq.asyncio.Context()
    socket = bound_socket(context, address)
    try:
        log.info("engine %s (epoch %s) serving at %s", engine.model_name, epoch, address)
        if on_ready is not None:
            on_ready(epoch)
        await EngineServer(engine, socket, epoch, client_timeout).run(stop, parent_pid)
    finally:
        socket.close()
        context.term()
        if address.startswith("ipc://"):
            Path(address.removeprefix("ipc://")).unlink(missing_ok=True)


# The engine process ------------------------------------------------------------------------


@dataclass
class EngineSpec:
    """Everything the engine process needs, as JSON (it crosses a process boundary)."""

    checkpoint: str
    address: str = ""  # "" : the supervisor picks an ipc:// path
    codec: str | None = None
    device: str | None = None
    dtype: str | None = None
    weight_format: str | None = None
    warmup: bool = True
    config: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT
    torch_threads: int | None = None  # None: torch's default
    parent_pid: int | None = None  # stop when this process is gone (set by the supervisor)
    log_level: str = "info"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        return wire.construct(cls, json.loads(text))

    def engine_config(self):
        """The EngineConfig (JSON lists back to the tuples the config holds)."""
        from shoal.config import EngineConfig

        values = {
            key: tuple(value) if isinstance(value, list) else value for key, value in self.config.items()
        }
        return EngineConfig(**values)


def exit_if_orphaned_while_loading(parent_pid: int, loaded: threading.Event) -> None:
    """Loading takes minutes on a GPU (weights, FP8 check, graph capture), before the serving
    loop's reaper watches the parent. A supervisor killed meanwhile must not leave this process
    holding the GPU: exit at once (nothing is served yet, nothing to stop cleanly)."""
    while not loaded.wait(REAP_INTERVAL):
        if os.getppid() != parent_pid:
            log.error("the supervising process %d is gone while loading: exiting", parent_pid)
            os._exit(1)


def engine_process_main(spec: EngineSpec) -> int:
    """The engine process: load the engine, serve it until SIGTERM or SIGINT, stop it cleanly."""
    logging.basicConfig(
        level=spec.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s"
    )
    import torch

    from shoal.engine.gc_pauses import freeze_startup_heap
    from shoal.engine.load import load_engine

    if spec.torch_threads is not None:
        torch.set_num_threads(spec.torch_threads)
    loaded = threading.Event()
    if spec.parent_pid is not None:
        threading.Thread(
            target=exit_if_orphaned_while_loading, args=(spec.parent_pid, loaded), daemon=True
        ).start()
    engine = load_engine(
        spec.checkpoint,
        codec=spec.codec,
        device=spec.device,
        dtype=spec.dtype,
        config=spec.engine_config(),
        weight_format=spec.weight_format,
        warmup=spec.warmup,
    )
    loaded.set()
    freeze_startup_heap()

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await engine.start()
        try:
            await serve_engine(
                engine,
                spec.address,
                stop=stop,
                client_timeout=spec.client_timeout,
                parent_pid=spec.parent_pid,
            )
        finally:
            await engine.stop()

    asyncio.run(serve())
    log.info("engine stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shoal.engine.process", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--spec", required=True, help="an EngineSpec as JSON")
    return engine_process_main(EngineSpec.from_json(parser.parse_args(argv).spec))


# The supervisor (parent side) --------------------------------------------------------------


def ping(address: str, timeout: float, context: zmq.Context | None = None) -> dict[str, Any] | None:
    """One ping on a fresh socket: the pong, or None if none came within `timeout` seconds."""
    own_context = context is None
    context = context or zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address)
        socket.send(wire.pack({"type": "ping", "seq": 0}))
        if socket.poll(int(timeout * 1000)):
            message = wire.unpack(socket.recv())
            if message["type"] == "pong":
                return message
        return None
    finally:
        socket.close()
        if own_context:
            context.term()


class EngineNotReady(EngineError):
    """The engine process died, or did not answer pings in time, while starting."""


class EngineSupervisor:
    """Runs the engine process from a parent that never imports torch: starts it and waits
    until it answers pings, restarts it when it exits (waiting `backoff` seconds, doubling
    after each quick failure up to `max_backoff`), and stops it (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        ready_timeout: float = 600.0,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        stable_after: float = 60.0,  # a process that lived this long resets the backoff
        stop_timeout: float = 30.0,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not spec.address:
            name = f"shoal-engine-{os.getpid()}-{secrets.token_hex(4)}.sock"
            spec = dataclasses.replace(spec, address=f"ipc://{Path(tempfile.gettempdir()) / name}")
        self.spec = dataclasses.replace(spec, parent_pid=os.getpid())
        self.ready_timeout = ready_timeout
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.stable_after = stable_after
        self.stop_timeout = stop_timeout
        self.python = python
        self.env = dict(env) if env is not None else None
        self.restarts = 0
        self.epoch: str | None = None  # of the process now running, once it answered
        self.process: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._started_at = 0.0
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def alive(self) -> bool:
        """The engine process runs and has answered a ping since it started."""
        process = self.process
        return process is not None and process.poll() is None and self._ready.is_set()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        """Start the engine process and wait until it answers (raises EngineNotReady)."""
        self._stopping.clear()
        self._spawn()
        try:
            self._wait_ready(self.ready_timeout)
        except BaseException:
            self._terminate()
            raise
        self._monitor = threading.Thread(target=self._supervise, name="shoal-engine-supervisor", daemon=True)
        self._monitor.start()

    def wait_ready(self, timeout: float) -> bool:
        """Block until an engine process answers (after a restart, too); False on timeout."""
        return self._ready.wait(timeout)

    def stop(self) -> None:
        self._stopping.set()
        self._terminate()
        if self._monitor is not None:
            self._monitor.join()
            self._monitor = None
        self._terminate()  # one the monitor may have spawned while `stop` began
        if self.address.startswith("ipc://"):
            Path(self.address.removeprefix("ipc://")).unlink(missing_ok=True)

    def __enter__(self) -> EngineSupervisor:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _spawn(self) -> None:
        command = [self.python, "-m", "shoal.engine.process", "--spec", self.spec.to_json()]
        with self._lock:
            if self._stopping.is_set():
                return
            self._ready.clear()
            self.epoch = None
            # A session of its own: a terminal's Ctrl+C reaches the parent, which stops the API
            # processes and then this one, instead of the engine dying first under live requests
            # (and being restarted during the shutdown). It still stops if the parent dies.
            self.process = subprocess.Popen(command, env=self.env, start_new_session=True)
            self._started_at = time.monotonic()
            log.info("engine process %d started", self.process.pid)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        context = zmq.Context()
        try:
            while not self._stopping.is_set():
                process = self.process
                if process is None or process.poll() is not None:
                    code = None if process is None else process.returncode
                    raise EngineNotReady(f"the engine process exited with code {code} while starting")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineNotReady(f"the engine process did not answer within {timeout:.0f} s")
                pong = ping(self.address, min(0.5, remaining), context)
                if pong is not None:
                    self.epoch = pong["epoch"]
                    self._ready.set()
                    log.info("engine process %d is ready (epoch %s)", process.pid, self.epoch)
                    return
        finally:
            context.term()

    def _supervise(self) -> None:
        """The monitor thread: wait for the process to exit; unless stopping, restart it."""
        failures = 0
        while not self._stopping.is_set():
            process = self.process
            assert process is not None
            code = process.wait()
            if self._stopping.is_set():
                return
            self._ready.clear()
            lived = time.monotonic() - self._started_at
            failures = 0 if lived >= self.stable_after else failures + 1
            delay = min(self.backoff * 2 ** max(failures - 1, 0), self.max_backoff)
            log.error("engine process %d exited with code %s after %.1f s; restarting in %.1f s",
                      process.pid, code, lived, delay)  # fmt: skip
            if self._stopping.wait(delay):
                return
            self.restarts += 1
            self._spawn()
            try:
                self._wait_ready(self.ready_timeout)
            except EngineNotReady as error:
                log.error("restarted engine process: %s", error)
                self._terminate()

    def _terminate(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            log.error("engine process %d did not stop in %.0f s: killing it", process.pid, self.stop_timeout)
            process.kill()
            process.wait()


__all__ = [
    "DEFAULT_CLIENT_TIMEOUT",
    "UNAVAILABLE",
    "EngineNotReady",
    "EngineServer",
    "EngineSpec",
    "EngineSupervisor",
    "engine_process_main",
    "ping",
    "serve_engine",
]


if __name__ == "__main__":
    sys.exit(main())

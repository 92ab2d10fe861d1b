"""`shoal serve --api-workers N`: the engine in a process of its own and N API processes.

  main process   reads the options, creates the tables and sweeps orphan blobs once, starts the
                 engine process, one per GPU with `--gpus` (`EngineSupervisor`: restarted
                 whenever it dies), then runs uvicorn's own multiprocess supervisor with N API
                 processes (restarted whenever one dies); on exit it stops the API processes,
                 then the engines.
  engine         `python -m shoal.engine.process`: scheduler, GPU loop, vocoder; no web imports.
  API processes  `create_worker_app`: HTTP, WebSocket, auth, database, format encoding (mp3 and
                 opus run here, in parallel), each with a `RemoteEngine` to the engine process
                 (several: a `RoutedEngine` over them, `engine/router.py`).

What the processes share lives in a runtime directory the main process creates and removes: the
engines' ipc sockets, the per-key stream counts' files (`limits.SharedStreamLimiter`) and
prometheus_client's multiprocess files. The job runner's lock is `jobs.lock` in the data
directory, so one process runs the jobs of a data directory (`jobs.JobLeadership`).

The main process imports neither torch nor the app: prometheus_client must first be imported
after `PROMETHEUS_MULTIPROC_DIR` is set, which the main process does before the workers start.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.engine.compile_cache import compile_cache_environment
from shoal.engine.process import EngineNotReady, EngineSpec, EngineSupervisor
from shoal.tuning import ENV_PREFIX, environment

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("shoal.server")

# SHOAL_API_WORKER_CONFIG: the API processes' `ApiWorkerConfig` as JSON, set by the main process.
WORKER_CONFIG_VARIABLE = "API_WORKER_CONFIG"
MULTIPROC_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own switch
APP_FACTORY = "shoal.server.workers:create_worker_app"
JOBS_LOCK_NAME = "jobs.lock"
# An API process (re)started while the engine restarts waits this long for it, then serves 503s.
WORKER_ENGINE_WAIT_SECONDS = 10.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
PARENT_CHECK_SECONDS = 0.5


@dataclass
class ApiWorkerConfig:
    """What every API process needs, as JSON (it crosses a process boundary)."""

    engine_addresses: list[str]  # one engine process per GPU (`--gpus`), in order
    runtime_dir: str
    data_dir: str
    database_url: str | None = None
    blob_url: str | None = None  # `--blob-url`; None: the data directory's blobs/
    settings: dict[str, Any] = field(default_factory=dict)  # ServerSettings fields
    log_level: str = "info"
    api_workers: int = 1
    main_pid: int = 0  # the `shoal serve` process: an API process stops when it is gone
    routing: dict[str, Any] = field(default_factory=dict)  # RoutingPolicy fields, several engines

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ApiWorkerConfig:
        return cls(**json.loads(text))

    @property
    def streams_dir(self) -> Path:
        return Path(self.runtime_dir) / "streams"

    @property
    def metrics_dir(self) -> Path:
        return Path(self.runtime_dir) / "metrics"


def jobs_lock_path(data_dir: Path) -> Path:
    return data_dir / JOBS_LOCK_NAME


def stop_when_parent_dies(parent: int) -> None:
    """A thread that ends this API process (as SIGTERM does: uvicorn's graceful shutdown) once
    its parent is gone (already, too: the pid comes from the parent, not from getppid here):
    uvicorn's workers outlive a killed main process otherwise, still holding the port, with no
    engine to serve."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SECONDS)
        log.error("the main process %d is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="shoal-parent-watch", daemon=True).start()


def create_worker_app() -> FastAPI:
    """One API process's app (uvicorn's factory): its config comes from the environment."""
    from shoal.config import RoutingPolicy
    from shoal.engine.gc_pauses import freeze_startup_heap
    from shoal.engine.remote import RemoteEngine
    from shoal.engine.router import RoutedEngine
    from shoal.server.app import create_app
    from shoal.server.limits import SharedStreamLimiter
    from shoal.server.settings import ServerSettings
    from shoal.server.store import Store

    text = environment(WORKER_CONFIG_VARIABLE)
    if not text:
        raise RuntimeError(
            f"{ENV_PREFIX}{WORKER_CONFIG_VARIABLE} is not set: start workers with `shoal serve`"
        )
    config = ApiWorkerConfig.from_json(text)
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    if config.api_workers > 1:  # with one, uvicorn serves in the main process itself
        stop_when_parent_dies(config.main_pid)
    settings = ServerSettings(**config.settings)
    data_dir = Path(config.data_dir)
    engines = [
        RemoteEngine(address, start_timeout=WORKER_ENGINE_WAIT_SECONDS, require_engine_at_start=False)
        for address in config.engine_addresses
    ]
    engine = engines[0] if len(engines) == 1 else RoutedEngine(engines, RoutingPolicy(**config.routing))
    app = create_app(
        engine,
        Store.in_directory(data_dir, config.database_url, config.blob_url),
        settings,
        limiter=SharedStreamLimiter(config.streams_dir, settings.max_streams_per_key),
        metrics_dir=config.metrics_dir,
        jobs_lock=jobs_lock_path(data_dir),
        sweep_blobs=False,
    )
    freeze_startup_heap()  # an API process's loop pauses like the engine's: see gc_pauses
    return app


def engine_environment(gpu: str | None, data_dir: Path) -> dict[str, str]:
    """An engine process's environment: this one's, with only its GPU visible (so that CUDA
    graphs, Triton and torch's current device are that GPU's without any device index), and its
    compilers' caches in the data directory (`engine/compile_cache.py`)."""
    environment = {**os.environ, **compile_cache_environment(data_dir)}
    if gpu is not None:
        environment["CUDA_VISIBLE_DEVICES"] = gpu
    return environment


def start_engines(supervisors: list[EngineSupervisor]) -> None:
    """Start every engine process at once (each loads and warms up for a while); raises the
    first EngineNotReady after stopping the ones that did start."""
    with ThreadPoolExecutor(max_workers=len(supervisors)) as pool:
        outcomes = list(pool.map(lambda supervisor: _started(supervisor), supervisors))
    failures = [outcome for outcome in outcomes if outcome is not None]
    if failures:
        for supervisor in supervisors:
            supervisor.stop()
        raise failures[0]


def _started(supervisor: EngineSupervisor) -> EngineNotReady | None:
    try:
        supervisor.start()
    except EngineNotReady as error:
        return error
    return None


def serve_split(
    spec: EngineSpec,
    *,
    engine_gpus: Sequence[str | None] = (None,),
    routing: dict[str, Any] | None = None,
    api_workers: int,
    data_dir: Path,
    database_url: str | None,
    blob_url: str | None = None,
    settings: dict[str, Any],
    host: str,
    port: int,
    ws_max_size: int,
    log_level: str,
) -> int:
    """Run one engine process per entry of `engine_gpus` (a CUDA_VISIBLE_DEVICES value, or
    None: as this process sees the devices) and `api_workers` API processes until SIGINT or
    SIGTERM. With several engines the API processes route between them (`routing`: the
    RoutingPolicy's fields)."""
    import uvicorn

    from shoal.server.store import Store

    # The tables exist (and the bucket is known usable) before N processes open them.
    store = Store.in_directory(data_dir, database_url, blob_url)
    try:
        removed = store.sweep_orphan_blobs()
        if removed:
            log.info("removed %d orphan blob files (left by an earlier crash)", removed)
    finally:
        store.close()
    runtime = Path(tempfile.mkdtemp(prefix="shoal-serve-"))
    try:
        config = ApiWorkerConfig(
            engine_addresses=[f"ipc://{runtime / f'engine-{i}.sock'}" for i in range(len(engine_gpus))],
            runtime_dir=str(runtime),
            data_dir=str(data_dir),
            database_url=database_url,
            blob_url=blob_url,
            settings=settings,
            log_level=log_level,
            api_workers=api_workers,
            main_pid=os.getpid(),
            routing=dict(routing or {}),
        )
        config.metrics_dir.mkdir()
        os.environ[MULTIPROC_VARIABLE] = str(config.metrics_dir)
        os.environ[ENV_PREFIX + WORKER_CONFIG_VARIABLE] = config.to_json()
        supervisors = [
            EngineSupervisor(
                dataclasses.replace(spec, address=address), env=engine_environment(gpu, data_dir)
            )
            for address, gpu in zip(config.engine_addresses, engine_gpus, strict=True)
        ]
        log.info("starting %d engine process(es)", len(supervisors))
        try:
            start_engines(supervisors)
        except EngineNotReady as error:
            log.error("an engine process did not start: %s", error)
            return 1
        # uvicorn re-raises the SIGTERM it handled once it has shut down (with one API process it
        # runs in this one): as Ctrl+C, so that the engine is stopped and the directory removed.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            pids = ", ".join(str(supervisor.pid) for supervisor in supervisors)
            log.info("engine process(es) %s ready; starting %d API processes", pids, api_workers)
            uvicorn.run(
                APP_FACTORY,
                factory=True,
                workers=api_workers,
                host=host,
                port=port,
                ws_max_size=ws_max_size,
                log_level=log_level.lower(),
                timeout_graceful_shutdown=5,
            )
        except KeyboardInterrupt:
            pass
        finally:
            with ThreadPoolExecutor(max_workers=len(supervisors)) as pool:
                list(pool.map(EngineSupervisor.stop, supervisors))
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    return 0


__all__ = ["ApiWorkerConfig", "create_worker_app", "jobs_lock_path", "serve_split"]

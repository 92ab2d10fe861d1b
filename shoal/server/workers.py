"""`shoal serve --api-workers N`: the engine in a process of its own and N API processes.

  main process   reads the options, creates the tables and sweeps orphan blobs once, starts the
                 engine process (`EngineSupervisor`: restarted whenever it dies), then runs
                 uvicorn's own multiprocess supervisor with N API processes (restarted whenever
                 one dies); on exit it stops the API processes, then the engine.
  engine         `python -m shoal.engine.process`: scheduler, GPU loop, vocoder; no web imports.
  API processes  `create_worker_app`: HTTP, WebSocket, auth, database, format encoding (mp3 and
                 opus run here, in parallel), each with a `RemoteEngine` to the engine process.

What the processes share lives in a runtime directory the main process creates and removes: the
engine's ipc socket, the stream slots' lock files (`limits.SharedStreamLimiter`) and
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

    engine_address: str
    runtime_dir: str
    data_dir: str
    database_url: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # ServerSettings fields
    log_level: str = "info"
    api_workers: int = 1
    main_pid: int = 0  # the `shoal serve` process: an API process stops when it is gone

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
    from shoal.engine.remote import RemoteEngine
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
    engine = RemoteEngine(
        config.engine_address, start_timeout=WORKER_ENGINE_WAIT_SECONDS, require_engine_at_start=False
    )
    return create_app(
        engine,
        Store.in_directory(data_dir, config.database_url),
        settings,
        limiter=SharedStreamLimiter(config.streams_dir, settings.max_streams_per_key),
        metrics_dir=config.metrics_dir,
        jobs_lock=jobs_lock_path(data_dir),
        sweep_blobs=False,
    )


def serve_split(
    spec: EngineSpec,
    *,
    api_workers: int,
    data_dir: Path,
    database_url: str | None,
    settings: dict[str, Any],
    host: str,
    port: int,
    ws_max_size: int,
    log_level: str,
) -> int:
    """Run the engine process and `api_workers` API processes until SIGINT or SIGTERM."""
    import uvicorn

    from shoal.server.store import Store

    store = Store.in_directory(data_dir, database_url)  # the tables exist before N processes open them
    try:
        removed = store.sweep_orphan_blobs()
        if removed:
            log.info("removed %d orphan blob files (left by an earlier crash)", removed)
    finally:
        store.close()
    runtime = Path(tempfile.mkdtemp(prefix="shoal-serve-"))
    try:
        config = ApiWorkerConfig(
            engine_address=f"ipc://{runtime / 'engine.sock'}",
            runtime_dir=str(runtime),
            data_dir=str(data_dir),
            database_url=database_url,
            settings=settings,
            log_level=log_level,
            api_workers=api_workers,
            main_pid=os.getpid(),
        )
        config.metrics_dir.mkdir()
        os.environ[MULTIPROC_VARIABLE] = str(config.metrics_dir)
        os.environ[ENV_PREFIX + WORKER_CONFIG_VARIABLE] = config.to_json()
        supervisor = EngineSupervisor(dataclasses.replace(spec, address=config.engine_address))
        log.info("starting the engine process")
        try:
            supervisor.start()
        except EngineNotReady as error:
            log.error("the engine process did not start: %s", error)
            return 1
        # uvicorn re-raises the SIGTERM it handled once it has shut down (with one API process it
        # runs in this one): as Ctrl+C, so that the engine is stopped and the directory removed.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            log.info("engine process %d ready; starting %d API processes", supervisor.pid, api_workers)
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
            supervisor.stop()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    return 0


__all__ = ["ApiWorkerConfig", "create_worker_app", "jobs_lock_path", "serve_split"]

"""The ASGI app: settings, shared state, routers, the engine's lifespan, and the small routes
(health, metrics, wallet) that need no module of their own.

`create_app(engine, store, settings)` is all a test or the CLI needs: the engine is started and
stopped with the app; routes reach the shared objects through `app.state`. An API process of a
server with several (`shoal.server.workers`) passes what they share: the stream limiter, the
metrics directory and the jobs lock.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

import anyio.to_thread
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.engine.api import Engine, EngineStats, EngineUnavailable
from shoal.engine.remote import RemoteEngine
from shoal.engine.router import RoutedEngine
from shoal.server import jobs, live, timestamps, tts, voices, web
from shoal.server.auth import Principal, require_principal
from shoal.server.errors import error_response, install_error_handlers
from shoal.server.limits import Limiter, StreamLimiter
from shoal.server.metrics import RequestCounterMiddleware, ServerMetrics
from shoal.server.openapi import errors, install_openapi
from shoal.server.schemas import Credits, EngineHealth, Health, Package
from shoal.server.settings import ServerSettings
from shoal.server.store import Store

log = logging.getLogger("shoal.server")
PROMETHEUS = "Prometheus text exposition format (version 0.0.4)"


class BodySizeLimit:
    """413 for any HTTP body over the limit, by Content-Length or while it streams in."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        declared = headers.get(b"content-length", b"")
        message = f"request body larger than {self.limit} bytes"
        if declared.isdigit() and int(declared) > self.limit:
            await error_response(413, message)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            event = await receive()
            received += len(event.get("body", b""))
            if received > self.limit:
                raise BodyTooLarge(message)
            return event

        response_started = False

        async def tracking_send(event: Message) -> None:
            nonlocal response_started
            response_started = response_started or event["type"] == "http.response.start"
            await send(event)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not response_started:
                await error_response(413, message)(scope, receive, send)


class BodyTooLarge(Exception):
    pass


def create_app(
    engine: Engine,
    store: Store,
    settings: ServerSettings | None = None,
    *,
    limiter: Limiter | None = None,
    metrics_dir: Path | None = None,
    jobs_lock: Path | None = None,
    sweep_blobs: bool = True,
) -> FastAPI:
    """The app. `limiter`: stream slots (default: counted in this process); `metrics_dir`: the
    API processes' prometheus multiprocess directory; `jobs_lock`: the file whose lock makes
    one process the job runner (None: this one); `sweep_blobs`: remove orphan blobs at start
    (a server of several processes does it once, before they start)."""
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.auth:
            log.warning("authentication is OFF (--no-auth): anyone who can reach this port may use it")
        if sweep_blobs:
            removed = await anyio.to_thread.run_sync(store.sweep_orphan_blobs)
            if removed:
                log.info("removed %d orphan blob files (left by an earlier crash)", removed)
        await engine.start()
        await app.state.jobs.start()  # resumes the jobs a previous process left unfinished
        try:
            yield
        finally:
            await app.state.jobs.stop()  # aborts in-flight job items; the jobs stay resumable
            await engine.stop()
            await app.state.voices.close()  # the voices' last use counts
            store.close()

    app = FastAPI(title="Shoal", summary="Fish Audio compatible TTS server", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.store = store
    app.state.limiter = limiter or StreamLimiter(settings.max_streams_per_key)
    app.state.voices = voices.VoiceResolver(engine, store, settings)
    app.state.jobs = jobs.JobRunner(engine, store, settings, jobs.JobLeadership(jobs_lock))
    app.state.metrics = ServerMetrics(engine, lambda: app.state.limiter.total, metrics_dir)
    install_error_handlers(app)
    install_openapi(app, settings.auth)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestCounterMiddleware)
    app.include_router(tts.router)
    app.include_router(live.router)
    app.include_router(voices.router)
    app.include_router(jobs.router)
    timestamps.install(app, settings)  # /v1/tts/stream/with-timestamp and the --aligner model
    app.include_router(system_router())
    app.include_router(web.router)  # the browser pages: /, /dashboard, /voices
    return app


HEALTH_STATS_TIMEOUT_SECONDS = 5.0


async def current_stats(engine: Engine) -> EngineStats:
    """The engine's stats now. An engine in another process is asked (not its last heartbeat's,
    up to half a second old and different in each API process), so that every API process
    answers alike and `pages_used` is back at `prefix_cache_pages` as soon as requests end."""
    if isinstance(engine, RemoteEngine | RoutedEngine):
        try:
            return await asyncio.wait_for(engine.refresh_stats(), HEALTH_STATS_TIMEOUT_SECONDS)
        except TimeoutError:
            raise EngineUnavailable(
                f"no stats from the engine within {HEALTH_STATS_TIMEOUT_SECONDS:g} s"
            ) from None
    # LocalEngine.stats() may wait for the engine's current step to end: never on the event loop.
    return await anyio.to_thread.run_sync(engine.stats)


def engine_health(engine: RoutedEngine) -> list[EngineHealth]:
    """Each engine's last heartbeat (at most half a second old)."""
    engines = []
    for status in engine.statuses():
        stats = status.stats
        load = (
            {}
            if stats is None
            else dict(
                running=stats.running,
                waiting=stats.waiting,
                pages_used=stats.pages_used,
                prefix_cache_pages=stats.prefix_cache_pages,
                frames_per_second=stats.frames_per_second,
                admitting=stats.admitting,
                admitted=stats.queue_wait_count,
            )
        )
        engines.append(
            EngineHealth(index=status.index, up=status.up, pid=status.pid, restarts=status.restarts, **load)
        )
    return engines


def system_router():
    from fastapi import APIRouter

    router = APIRouter(tags=["system"])

    @router.get("/v1/health", response_model=Health, operation_id="health", responses=errors(503))
    @router.post("/v1/health", response_model=Health, operation_id="health_post", responses=errors(503))
    async def health(request: Request) -> Health:
        """Liveness plus the engine's load; `pages_used` returns to 0 when no request runs. 503
        while the engine process is down or restarting."""
        engine: Engine = request.app.state.engine
        stats = await current_stats(engine)  # EngineUnavailable: the 503
        limiter: Limiter = request.app.state.limiter
        return Health(
            model=engine.model_name,
            sample_rate=engine.sample_rate,
            running=stats.running,
            waiting=stats.waiting,
            pages_used=stats.pages_used,
            pages_free=stats.pages_free,
            prefix_cache_pages=stats.prefix_cache_pages,
            frames_per_second=stats.frames_per_second,
            active_streams=limiter.total,
            api_process=os.getpid(),
            engines=engine_health(engine) if isinstance(engine, RoutedEngine) else None,
        )

    @router.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": PROMETHEUS}})
    async def metrics(request: Request) -> Response:
        text = await anyio.to_thread.run_sync(request.app.state.metrics.render)  # reads engine.stats()
        return Response(text, media_type="text/plain; version=0.0.4")

    @router.get("/wallet/{user_id}/api-credit", response_model=Credits, responses=errors(401))
    async def api_credit(
        user_id: str, principal: Annotated[Principal, Depends(require_principal)]
    ) -> JSONResponse:
        """A self-hosted server has no billing: report a large, never-decreasing balance."""
        now = dt.datetime.now(dt.UTC).isoformat()
        credits = Credits(
            _id=f"credit-{principal.tenant}", user_id=principal.tenant, credit="1000000000", created_at=now,
            updated_at=now,
        )  # fmt: skip
        return JSONResponse(credits.model_dump(by_alias=True))

    @router.get("/wallet/{user_id}/package", response_model=Package, responses=errors(401))
    async def package(
        user_id: str, principal: Annotated[Principal, Depends(require_principal)]
    ) -> JSONResponse:
        now = dt.datetime.now(dt.UTC).isoformat()
        unlimited = Package(
            _id=f"package-{principal.tenant}", user_id=principal.tenant, type="self-hosted", total=10**9,
            balance=10**9, created_at=now, updated_at=now, finished_at="",
        )  # fmt: skip
        return JSONResponse(unlimited.model_dump(by_alias=True))

    return router

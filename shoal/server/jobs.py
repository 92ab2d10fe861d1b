"""Bulk synthesis jobs (`/v1/jobs`): many texts (chapters, dialogue lines) into one audio file
each, in the background, at the engine's batch priority, so live traffic always comes first.

A job is checkpointed item by item: each finished item's audio goes to blob storage and its row
is marked done before the worker takes another item, so a restart resumes at the first
unfinished item and never records a finished one again. The voice is resolved once, at
creation, and its reference codes are stored with the job (deleting the voice later does not
break a running job). `EngineOverloaded` means "the batch queue is full, come back later" and
`EngineUnavailable` "the engine process is restarting": either way the item starts over with
backoff (its partial audio dropped), it does not fail. Each job runs at most `job_concurrency`
engine requests at once, and all jobs together at most `jobs_max_concurrency`.

One process per data directory runs jobs, however many API processes serve the routes: the one
holding an exclusive `flock` on the data directory's `jobs.lock` (`JobLeadership`). The others
try to take it every few seconds, so when the runner's process dies (the kernel drops its lock)
another takes over and resumes its jobs. The runner learns of jobs created or cancelled in other
processes by reading the database every `POLL_SECONDS`.

Servers with data directories of their own sharing one database (pods) split the jobs: a runner
works only on jobs it holds a lease on in the database (`Store.claim_job`), at most as many as
its engine slots can run at once, renews the leases while it works, and stops a job whose lease
another runner took over. A server that dies stops renewing; once its leases run out
(`job_lease_seconds`) the other servers take its jobs and resume them at their first unfinished
item.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from shoal.engine.api import (
    Engine,
    EngineOverloaded,
    EngineUnavailable,
    FinishReason,
    InvalidRequest,
    Priority,
    SynthesisRequest,
    VoiceReference,
)
from shoal.server import audio
from shoal.server.auth import Principal, require_principal
from shoal.server.errors import ApiError
from shoal.server.openapi import audio_response, body, errors
from shoal.server.schemas import MAX_PAGE_NUMBER, JobCreateBody, JobEntity, JobItemEntity, JobPage
from shoal.server.settings import ServerSettings
from shoal.server.store import JOB_ACTIVE, JobItemRow, JobRow, Store, codes_from_bytes
from shoal.server.synthesis import build_synthesis_request, encode_chunk, make_encoder, parse_model

log = logging.getLogger("shoal.server.jobs")

RETRY_INITIAL_SECONDS = 0.1  # first wait after EngineOverloaded; doubles up to the maximum
RETRY_MAX_SECONDS = 5.0
# While the engine process restarts a retry fails at once, in this process (no engine to ask):
# retry often, so the items go on as soon as it is back.
UNAVAILABLE_RETRY_MAX_SECONDS = 1.0
JOB_LIMIT_RETRY_AFTER_SECONDS = 30  # a 429 for too many unfinished jobs: jobs take minutes
POLL_SECONDS = 0.5  # how often the runner reads which jobs are active (created, cancelled elsewhere)
LEADERSHIP_RETRY_SECONDS = 2.0  # how often a process without the runner's role tries to take it
RUNNER_ID_NAME = "jobs.runner"  # beside jobs.lock: the data directory's name in job leases
# Fields of the request that are not job options: the texts are items, the voice is a snapshot.
NOT_OPTIONS = {"text", "items", "references", "reference_id"}


class ItemFailed(Exception):
    """An item that cannot be synthesized (invalid input, engine error): the job fails."""

    def __init__(self, item_id: str, reason: str) -> None:
        super().__init__(f"item {item_id}: {reason}")
        self.item_id = item_id
        self.reason = reason


class JobLeadership:
    """The runner's role among the processes sharing a data directory: an exclusive flock on
    `path`, held until `release` or the process's death. `path=None`: always this process's."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self.path is None or self._fd is not None

    def try_acquire(self) -> bool:
        if self.held:
            return True
        assert self.path is not None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def runner_id(self) -> str:
        """This runner's name in the database's job leases: the same for every process that
        takes the role on this data directory (kept in a file beside the lock), so a process
        taking over from a dead one resumes its jobs at once instead of waiting for their
        leases to run out; another data directory (another pod) has a name of its own."""
        if self.path is None:
            return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        name_file = self.path.with_name(RUNNER_ID_NAME)
        try:
            return name_file.read_text().strip()
        except FileNotFoundError:
            pass
        name = f"{socket.gethostname()}:{secrets.token_hex(6)}"
        temporary = name_file.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(name)
        try:
            os.link(temporary, name_file)  # the first process to name the directory wins
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
        return name_file.read_text().strip()


class JobRunner:
    """Runs every queued or running job in background tasks on the server's event loop, in the
    one process that holds `leadership`; in the others it only creates and cancels rows."""

    def __init__(
        self, engine: Engine, store: Store, settings: ServerSettings, leadership: JobLeadership | None = None
    ) -> None:
        self.engine = engine
        self.store = store
        self.settings = settings
        self.leadership = leadership or JobLeadership(None)
        self.runner_id = self.leadership.runner_id()
        # Jobs held at once: as many as the engine slots run together, so that other servers
        # sharing the database take the rest.
        self.max_jobs = max(1, settings.jobs_max_concurrency // max(1, settings.job_concurrency))
        self._renewed_at = 0.0
        self._slots = asyncio.Semaphore(settings.jobs_max_concurrency)
        self._tasks: dict[str, asyncio.Task] = {}
        self._leading: asyncio.Task | None = None

    @property
    def leading(self) -> bool:
        return self._leading is not None and self.leadership.held

    async def start(self) -> None:
        """Start taking the runner's role; once held, resume every job left unfinished."""
        self._leading = asyncio.create_task(self._lead(), name="job-runner")

    async def stop(self) -> None:
        """Abort in-flight items and leave the jobs as they are in the database (resumable)."""
        tasks = [task for task in (self._leading, *self._tasks.values()) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._leading = None
        self.leadership.release()

    async def _lead(self) -> None:
        while not await anyio.to_thread.run_sync(self.leadership.try_acquire):
            await asyncio.sleep(LEADERSHIP_RETRY_SECONDS)
        if self.leadership.path is not None:
            log.info("this process (%d) runs the bulk jobs", os.getpid())
        while True:
            try:
                await self._follow_database()
            except Exception:  # a database hiccup must not stop the jobs for good
                log.exception("reading the active jobs failed")
            await asyncio.sleep(POLL_SECONDS)

    async def _follow_database(self) -> None:
        """Renew the leases of the jobs running here and stop the ones lost; run the active jobs
        not running here (new, resumed, or created by another process) while there is room; stop
        the running ones no longer active (cancelled by another process)."""
        running = set(self._tasks)  # before the query: a job launched meanwhile is not "gone"
        lease = self.settings.job_lease_seconds
        if running and time.monotonic() - self._renewed_at >= lease / 3:
            held = await anyio.to_thread.run_sync(self.store.renew_job_leases, self.runner_id, running, lease)
            self._renewed_at = time.monotonic()
            for job_id in running - held:
                log.warning("job %s was taken over by another server: stopping it here", job_id)
                self._stop_task(job_id)
        # Jobs another server holds are left out: trying them would fill this runner's room with
        # claims that fail, and the jobs after them would never be reached.
        active = await anyio.to_thread.run_sync(self.store.active_job_ids, self.runner_id)
        for job_id in active:
            self.launch(job_id)
        for job_id in running - set(active):
            self._stop_task(job_id)

    def _stop_task(self, job_id: str) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    def launch(self, job_id: str) -> None:
        """Run the job now if this process is the runner, has room and gets the job's lease
        (else a runner finds it in the database within `POLL_SECONDS` once one has room)."""
        if not self.leading or job_id in self._tasks or len(self._tasks) >= self.max_jobs:
            return
        task = asyncio.create_task(self._run(job_id), name=f"job-{job_id}")
        self._tasks[job_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job_id, None))

    async def cancel(self, job_id: str) -> None:
        """Mark the job cancelled (if it still had work); if it runs here, abort its in-flight
        engine requests and wait until they are gone, so their KV pages are freed."""
        await anyio.to_thread.run_sync(self.store.set_job_status, job_id, "cancelled")
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def _run(self, job_id: str) -> None:
        """Run the job if its lease is ours; give the lease back however it ends."""
        lease = self.settings.job_lease_seconds
        if not await anyio.to_thread.run_sync(self.store.claim_job, job_id, self.runner_id, lease):
            return  # another server runs it
        try:
            await self._run_claimed(job_id)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.store.release_job, job_id, self.runner_id)

    async def _run_claimed(self, job_id: str) -> None:
        try:
            job = await anyio.to_thread.run_sync(self.store.get_job, job_id)
            if job is None or not await anyio.to_thread.run_sync(
                self.store.set_job_status, job_id, "running"
            ):
                return  # cancelled before it started
            if await anyio.to_thread.run_sync(self.store.reset_running_job_items, job_id):
                log.info("resuming job %s", job_id)
            body = JobCreateBody.model_validate(job.options)
            references = await anyio.to_thread.run_sync(self._references, job)
            items = await anyio.to_thread.run_sync(self.store.job_items, job_id)
            pending = collections.deque(item for item in items if item.status != "done")
            workers = min(self.settings.job_concurrency, len(pending))
            async with asyncio.TaskGroup() as group:
                for _ in range(workers):
                    group.create_task(self._work(job, body, references, pending))
        except* ItemFailed as failures:
            message = str(failures.exceptions[0])
            log.warning("job %s failed: %s", job_id, message)
            await anyio.to_thread.run_sync(lambda: self.store.set_job_status(job_id, "failed", error=message))
        except* Exception as errors:
            log.error("job %s failed unexpectedly", job_id, exc_info=errors.exceptions[0])
            await anyio.to_thread.run_sync(
                lambda: self.store.set_job_status(job_id, "failed", error="internal server error")
            )
        else:
            await anyio.to_thread.run_sync(self.store.set_job_status, job_id, "done")

    def _references(self, job: JobRow) -> tuple[VoiceReference, ...]:
        return tuple(
            VoiceReference(text=ref["text"], codes=codes_from_bytes(self.store.blobs.get(ref["codes_blob"])))
            for ref in job.references
        )

    async def _work(
        self,
        job: JobRow,
        body: JobCreateBody,
        references: tuple[VoiceReference, ...],
        pending: collections.deque[JobItemRow],
    ) -> None:
        """One of the job's workers: take the next unfinished item, synthesize, checkpoint."""
        while pending:
            item = pending.popleft()
            async with self._slots:
                await anyio.to_thread.run_sync(self.store.mark_job_item_running, job.id, item.position)
                try:
                    data, seconds = await self._synthesize(body, references, item)
                except ItemFailed as failure:
                    await anyio.to_thread.run_sync(
                        self.store.fail_job_item, job.id, item.position, failure.reason
                    )
                    raise
            extension = audio.FILE_EXTENSIONS[body.format]
            await anyio.to_thread.run_sync(
                self.store.finish_job_item, job.id, item.position, data, extension, seconds
            )

    async def _synthesize(
        self, body: JobCreateBody, references: tuple[VoiceReference, ...], item: JobItemRow
    ) -> tuple[bytes, float]:
        """One item's whole audio file and its duration in seconds, starting over (with
        exponential backoff: bulk work is never urgent) while the engine is full or away."""
        try:  # checked at creation; settings may have changed across a restart
            synthesis = build_synthesis_request(
                body, references, Priority.BATCH, self.settings, text=item.text
            )
        except ApiError as error:
            raise ItemFailed(item.item_id, error.message) from error
        delay = RETRY_INITIAL_SECONDS
        while True:
            try:
                return await self._attempt(body, synthesis, item)
            except (EngineOverloaded, EngineUnavailable) as error:
                log.debug("item %s of a job waits %.1f s: %s", item.item_id, delay, error)
                await asyncio.sleep(delay)
                cap = (
                    UNAVAILABLE_RETRY_MAX_SECONDS
                    if isinstance(error, EngineUnavailable)
                    else RETRY_MAX_SECONDS
                )
                delay = min(delay * 2, cap)

    async def _attempt(
        self, body: JobCreateBody, synthesis: SynthesisRequest, item: JobItemRow
    ) -> tuple[bytes, float]:
        """One try: submit and take the whole audio. The engine's refusals arrive at submit (in
        process) or at the first chunk (engine process); EngineUnavailable at any point."""
        try:
            encoder = make_encoder(body, self.engine.sample_rate, streaming=False)  # one per try
        except ApiError as error:
            raise ItemFailed(item.item_id, error.message) from error
        parts: list[bytes] = []
        samples = 0
        try:
            handle = self.engine.submit(synthesis)
            try:
                async for chunk in handle:
                    samples += len(chunk.samples)
                    parts.append(await encode_chunk(encoder, chunk.samples))
            finally:
                if handle.finish_reason is None:  # cancelled: abort the request, free its pages
                    with anyio.CancelScope(shield=True):
                        await handle.aclose()
        except InvalidRequest as error:
            raise ItemFailed(item.item_id, str(error) or "invalid request") from error
        if handle.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            raise ItemFailed(item.item_id, f"synthesis failed (engine finish reason: {handle.finish_reason})")
        parts.append(await anyio.to_thread.run_sync(encoder.finish))
        speed = body.prosody.speed if body.prosody else 1.0
        return b"".join(parts), samples / self.engine.sample_rate / speed


# ---- routes ---------------------------------------------------------------------------------


def checked_items(body: JobCreateBody, settings: ServerSettings) -> list[tuple[str, str]]:
    """The job's (item id, text) pairs, or a 4xx naming the first problem."""
    if body.items is None:
        if not body.text.strip():
            raise ApiError(400, "a job needs 'text' or a non-empty 'items' list")
        pairs = [("0", body.text)]
    else:
        if body.text.strip():
            raise ApiError(400, "give either 'text' or 'items', not both")
        if not body.items:
            raise ApiError(400, "'items' is empty")
        pairs = [(item.id or str(position), item.text) for position, item in enumerate(body.items)]
    if len(pairs) > settings.max_job_items:
        raise ApiError(413, f"a job holds at most {settings.max_job_items} items ({len(pairs)} given)")
    seen: set[str] = set()
    for item_id, text in pairs:
        if item_id in seen:
            raise ApiError(400, f"duplicate item id: {item_id}")
        seen.add(item_id)
        if not text.strip():
            raise ApiError(400, f"item {item_id}: text is empty")
        if len(text) > settings.max_text_length:
            raise ApiError(413, f"item {item_id}: text is longer than {settings.max_text_length} characters")
    return pairs


def item_status(job: JobRow, item: JobItemRow) -> str:
    """An item of a job that ended (cancelled, failed) is no longer running, whatever its row
    says until a runner resets it."""
    if item.status == "running" and job.status not in JOB_ACTIVE:
        return "pending"
    return item.status


def job_entity(row: JobRow, items: list[JobItemRow] | None = None) -> JobEntity:
    """A job as the API shows it; with `items`, each item's state."""
    entities = None
    if items is not None:
        entities = [
            JobItemEntity(
                id=item.item_id,
                status=item_status(row, item),  # type: ignore[arg-type]
                audio_seconds=item.audio_seconds,
                error=item.error,
            )
            for item in items
        ]
    return JobEntity(
        id=row.id,
        status=row.status,  # type: ignore[arg-type]
        items_total=row.items_total,
        items_done=row.items_done,
        audio_seconds=round(row.audio_seconds, 3),
        format=row.options.get("format", "mp3"),
        error=row.error,
        created_at=row.created_at,
        updated_at=row.updated_at,
        finished_at=row.finished_at,
        items=entities,
    )


def runner_of(request: Request) -> JobRunner:
    return request.app.state.jobs


router = APIRouter(tags=["jobs"])
Principal_ = Annotated[Principal, Depends(require_principal)]
Runner_ = Annotated[JobRunner, Depends(runner_of)]


async def owned_job(runner: JobRunner, principal: Principal, job_id: str) -> JobRow:
    """The caller's job; another tenant's job is indistinguishable from a missing one (404)."""
    row = await anyio.to_thread.run_sync(runner.store.get_job, job_id)
    if row is None or row.tenant != principal.tenant:
        raise ApiError(404, f"job not found: {job_id}")
    return row


async def detailed(runner: JobRunner, job_id: str) -> JSONResponse:
    row = await anyio.to_thread.run_sync(runner.store.get_job, job_id)
    items = await anyio.to_thread.run_sync(runner.store.job_items, job_id)
    entity = job_entity(row, items)
    return JSONResponse(entity.model_dump(mode="json"))


@router.post(
    "/v1/jobs",
    status_code=202,
    response_model=JobEntity,
    responses=errors(400, 401, 404, 413, 422, 429),
    openapi_extra=body(JobCreateBody),
)
async def create_job(request: Request, principal: Principal_, runner: Runner_) -> JSONResponse:
    """Queue a bulk job (202); poll `GET /v1/jobs/{id}`, fetch each item's file when done."""
    settings: ServerSettings = request.app.state.settings
    body = await parse_model(request, JobCreateBody)
    assert isinstance(body, JobCreateBody)
    items = checked_items(body, settings)
    make_encoder(body, runner.engine.sample_rate, streaming=False)  # 400 now for a bad format/rate/bitrate
    active = await anyio.to_thread.run_sync(runner.store.count_active_jobs, principal.tenant)
    if active >= settings.max_jobs_per_tenant:
        raise ApiError(
            429,
            f"too many unfinished jobs for this account (limit {settings.max_jobs_per_tenant})",
            retry_after=JOB_LIMIT_RETRY_AFTER_SECONDS,
        )
    references = await request.app.state.voices.resolve(principal, body)
    options = body.model_dump(mode="json", exclude=NOT_OPTIONS)
    pairs = [(reference.text, reference.codes) for reference in references]
    row = await anyio.to_thread.run_sync(
        lambda: runner.store.create_job(principal.tenant, options, pairs, items)
    )
    runner.launch(row.id)
    return JSONResponse(job_entity(row).model_dump(mode="json"), status_code=202)


@router.get("/v1/jobs", response_model=JobPage, responses=errors(401, 422))
async def list_jobs(
    principal: Principal_,
    runner: Runner_,
    page_size: Annotated[int, Query(ge=1, le=100)] = 10,
    page_number: Annotated[int, Query(ge=1, le=MAX_PAGE_NUMBER)] = 1,
) -> JSONResponse:
    """The caller's jobs, newest first, without their item lists."""
    total, rows = await anyio.to_thread.run_sync(
        lambda: runner.store.list_jobs(principal.tenant, (page_number - 1) * page_size, page_size)
    )
    page = JobPage(
        total=total, items=[job_entity(row) for row in rows], has_more=page_number * page_size < total
    )
    return JSONResponse(page.model_dump(mode="json"))


@router.get("/v1/jobs/{job_id}", response_model=JobEntity, responses=errors(401, 404))
async def get_job(job_id: str, principal: Principal_, runner: Runner_) -> JSONResponse:
    await owned_job(runner, principal, job_id)
    return await detailed(runner, job_id)


@router.get(
    "/v1/jobs/{job_id}/items/{item_id}",
    responses={**audio_response("the item's audio file"), **errors(401, 404, 409)},
)
async def get_job_item(job_id: str, item_id: str, principal: Principal_, runner: Runner_) -> Response:
    """A finished item's audio file (409 while it is not finished yet)."""
    job = await owned_job(runner, principal, job_id)
    item = await anyio.to_thread.run_sync(runner.store.job_item, job_id, item_id)
    if item is None:
        raise ApiError(404, f"job {job_id} has no item {item_id}")
    if item.status != "done" or item.audio_blob is None:
        raise ApiError(409, f"item {item_id} is not finished (status: {item.status}, job: {job.status})")
    data = await anyio.to_thread.run_sync(runner.store.blobs.get, item.audio_blob)
    media_type = audio.CONTENT_TYPES[job.options.get("format", "mp3")]
    return Response(data, media_type=media_type)


@router.delete("/v1/jobs/{job_id}", response_model=JobEntity, responses=errors(401, 404))
async def cancel_job(job_id: str, principal: Principal_, runner: Runner_) -> JSONResponse:
    """Cancel: in-flight items are aborted (their KV pages freed), finished items stay
    downloadable. A job that already ended is left as it is."""
    job = await owned_job(runner, principal, job_id)
    if job.status in JOB_ACTIVE:
        await runner.cancel(job_id)
    return await detailed(runner, job_id)

"""Durable state: API keys, voices and bulk jobs in SQL (SQLite by default, any SQLAlchemy URL works), voice
audio, codec codes and job audio as blobs (`blobs.py`: a local directory by default, or an
S3-compatible bucket with a disk cache). Nothing lives only in memory, so a restart loses nothing.

All methods are synchronous (SQLAlchemy + file or S3 IO); async routes call them in a worker thread.
"""

from __future__ import annotations

import datetime as dt
import io
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    create_engine,
    delete,
    event,
    func,
    or_,
    select,
    update,
)
from sqlalchemy import text as sql_text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, sessionmaker
from sqlalchemy.types import TypeDecorator

from shoal.server.blobs import BlobStore, blob_store_for

# Blobs younger than this are never swept: their rows may be about to commit.
ORPHAN_GRACE_SECONDS = 300.0
# PostgreSQL advisory lock taken while the tables are created: pods starting together on an
# empty database would otherwise race to create the same tables (and fail on a unique index).
SCHEMA_LOCK_ID = 0x5348_4F41_4C00  # "SHOAL"


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UTCDateTime(TypeDecorator):
    """A timestamp stored in UTC and read back timezone-aware on every database: SQLite keeps no
    zone, so without this a row read back would lose the `Z` it was created with."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware")
        return value.astimezone(dt.UTC) if value is not None else None

    def process_result_value(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    pass


class ApiKeyRow(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    tenant: Mapped[str] = mapped_column(String(100), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    priority: Mapped[str] = mapped_column(String(20), default="standard")  # standard | batch
    max_streams: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utc_now)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class VoiceRow(Base):
    __tablename__ = "voices"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(100), index=True)
    title: Mapped[str] = mapped_column(String(500))
    description: Mapped[str] = mapped_column(Text, default="")
    visibility: Mapped[str] = mapped_column(String(20), default="private")
    tags: Mapped[list] = mapped_column(JSON, default=list)
    languages: Mapped[list] = mapped_column(JSON, default=list)
    cover_image: Mapped[str] = mapped_column(String(500), default="")  # blob key or ""
    task_count: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utc_now)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utc_now)
    samples: Mapped[list[SampleRow]] = relationship(
        back_populates="voice", order_by="SampleRow.position", cascade="all, delete-orphan", lazy="selectin"
    )


class SampleRow(Base):
    __tablename__ = "voice_samples"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    voice_id: Mapped[str] = mapped_column(ForeignKey("voices.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text, default="")
    audio_blob: Mapped[str] = mapped_column(String(500))
    codes_blob: Mapped[str] = mapped_column(String(500))
    voice: Mapped[VoiceRow] = relationship(back_populates="samples")


JOB_ACTIVE = ("queued", "running")  # a job in one of these states still has work to do


class JobRow(Base):
    """A bulk synthesis job: its options (the TTSRequest fields, minus text and inline audio), a
    snapshot of its voice (reference codes as blobs, so a resume never re-resolves the voice) and
    the running totals the status route reports."""

    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(100), index=True)
    status: Mapped[str] = mapped_column(String(20), index=True)  # queued|running|done|failed|cancelled
    options: Mapped[dict] = mapped_column(JSON, default=dict)
    references: Mapped[list] = mapped_column(JSON, default=list)  # [{"text", "codes_blob"}]
    items_total: Mapped[int] = mapped_column(Integer, default=0)
    items_done: Mapped[int] = mapped_column(Integer, default=0)
    audio_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utc_now)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utc_now)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class JobItemRow(Base):
    __tablename__ = "job_items"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    item_id: Mapped[str] = mapped_column(String(128))
    text: Mapped[str] = mapped_column(Text)
    # pending | running | done | failed; "running" is written by the job runner as it submits
    # the item, and reset to pending when a runner (re)starts the job (a runner that died left it).
    status: Mapped[str] = mapped_column(String(20), default="pending")
    audio_blob: Mapped[str | None] = mapped_column(String(500), nullable=True)
    audio_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class JobLeaseRow(Base):
    """Which job runner works on a job, and until when. Servers sharing the database (pods) each
    run the jobs they hold a lease on and renew it while they work; a runner that died stops
    renewing, and another takes the job over once the lease has run out, resuming at its first
    unfinished item. A table of its own, so that databases made before it only gain a table."""

    __tablename__ = "job_leases"
    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    runner: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)


class VoiceExistsError(ValueError):
    """A voice with this id exists already (the id is the name in fish-speech's routes)."""


def codes_to_bytes(codes: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(codes), allow_pickle=False)
    return buffer.getvalue()


def codes_from_bytes(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


@dataclass(frozen=True)
class NewSample:
    """One uploaded voice sample, already codec-encoded."""

    text: str
    audio: bytes
    codes: np.ndarray


def database_url_for(url: str) -> str:
    """`url` with PostgreSQL's driver made explicit: a bare `postgresql://` (or `postgres://`)
    means psycopg 3 (`pip install 'shoal[postgres]'`), not SQLAlchemy's default psycopg2, which
    Shoal does not install. Any other URL, or one that names its driver, is returned as it is."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme) :]
    return url


def sqlite_for_several_processes(connection, _record) -> None:
    """SQLite as the API processes of one server share it: write-ahead logging, so a write never
    blocks the readers (in the default rollback journal every write locked them out, and a
    request that hit the lock slept in SQLite's busy handler: docs/performance.md's ledger);
    `synchronous=NORMAL`, the durable setting for that log (a commit survives a crash of the
    process; a power cut may lose the last ones, never corrupt the file); and a busy wait of up
    to 5 s before "database is locked". The log needs one host's shared memory: keep the file on
    a local disk, not a network share (PostgreSQL for several hosts)."""
    cursor = connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=5000")
    finally:
        cursor.close()


class Store:
    """The SQL database and the blob store behind keys, voices and jobs."""

    def __init__(self, database_url: str, blobs: BlobStore) -> None:
        database_url = database_url_for(database_url)
        connect_args = {"check_same_thread": False} if database_url.startswith("sqlite") else {}
        self.engine = create_engine(database_url, connect_args=connect_args, pool_pre_ping=True)
        if database_url.startswith("sqlite"):
            event.listen(self.engine, "connect", sqlite_for_several_processes)
        with self.engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(sql_text("SELECT pg_advisory_xact_lock(:id)"), {"id": SCHEMA_LOCK_ID})
            Base.metadata.create_all(connection)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.blobs = blobs

    @classmethod
    def in_directory(
        cls, data_dir: Path, database_url: str | None = None, blob_url: str | None = None
    ) -> Store:
        """The store of a data directory: its SQLite file unless `database_url` names another
        database, its `blobs/` directory unless `blob_url` names other blob storage
        (`blobs.blob_store_for`; an S3 bucket keeps its disk cache in the data directory)."""
        data_dir.mkdir(parents=True, exist_ok=True)
        url = database_url or f"sqlite:///{data_dir / 'shoal.db'}"
        blobs = blob_store_for(blob_url, data_dir)
        try:
            return cls(url, blobs)
        except BaseException:
            blobs.close()
            raise

    def close(self) -> None:
        self.engine.dispose()
        self.blobs.close()

    # ---- API keys -------------------------------------------------------------------------

    def add_key(
        self,
        key_hash: str,
        tenant: str,
        name: str = "",
        priority: str = "standard",
        max_streams: int | None = None,
    ) -> ApiKeyRow:
        row = ApiKeyRow(
            id="key_" + uuid.uuid4().hex[:16],
            key_hash=key_hash,
            tenant=tenant,
            name=name,
            priority=priority,
            max_streams=max_streams,
        )
        with self.sessions.begin() as session:
            session.add(row)
        return row

    def find_key(self, key_hash: str) -> ApiKeyRow | None:
        """The active (not revoked) key with this hash."""
        with self.sessions() as session:
            row = session.scalar(select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash))
            return row if row is not None and row.revoked_at is None else None

    def list_keys(self) -> list[ApiKeyRow]:
        with self.sessions() as session:
            return list(session.scalars(select(ApiKeyRow).order_by(ApiKeyRow.created_at)))

    def revoke_key(self, key_id: str) -> bool:
        with self.sessions.begin() as session:
            row = session.get(ApiKeyRow, key_id)
            if row is None or row.revoked_at is not None:
                return False
            row.revoked_at = utc_now()
            return True

    # ---- voices ---------------------------------------------------------------------------

    def create_voice(
        self,
        tenant: str,
        title: str,
        samples: list[NewSample],
        *,
        description: str = "",
        visibility: str = "private",
        tags: list[str] | None = None,
        languages: list[str] | None = None,
        cover_image: bytes | None = None,
        voice_id: str | None = None,
    ) -> VoiceRow:
        voice_id = voice_id or uuid.uuid4().hex
        # Blob keys are unique per sample, never derived from the id alone: ids are reused (a
        # renamed voice keeps its blobs, and anyone may then take its old id), and a new voice
        # must never overwrite, or on deletion remove, another voice's audio and codes.
        written: list[str] = []
        row = VoiceRow(
            id=voice_id,
            tenant=tenant,
            title=title,
            description=description,
            visibility=visibility,
            tags=list(tags or []),
            languages=list(languages or []),
        )
        try:
            for position, sample in enumerate(samples):
                sample_id = uuid.uuid4().hex
                audio_key = f"voices/{voice_id}/{sample_id}.audio"
                codes_key = f"voices/{voice_id}/{sample_id}.npy"
                written += [audio_key, codes_key]
                self.blobs.put(audio_key, sample.audio)
                self.blobs.put(codes_key, codes_to_bytes(sample.codes))
                row.samples.append(
                    SampleRow(
                        id=sample_id,
                        position=position,
                        text=sample.text,
                        audio_blob=audio_key,
                        codes_blob=codes_key,
                    )
                )
            if cover_image:
                row.cover_image = f"voices/{voice_id}/cover-{uuid.uuid4().hex}"
                written.append(row.cover_image)
                self.blobs.put(row.cover_image, cover_image)
            with self.sessions.begin() as session:
                session.add(row)
        except BaseException as error:
            for key in written:
                self.blobs.delete(key)
            if isinstance(error, IntegrityError):  # a concurrent create took the id first
                raise VoiceExistsError(f"voice already exists: {voice_id}") from error
            raise
        return row

    def get_voice(self, voice_id: str) -> VoiceRow | None:
        with self.sessions() as session:
            return session.get(VoiceRow, voice_id)

    def list_voices(
        self,
        *,
        visible_to: str,
        own_only: bool,
        title: str | None = None,
        tags: list[str] | None = None,
        languages: list[str] | None = None,
        author_id: str | None = None,
        sort_by: str = "task_count",
        offset: int = 0,
        limit: int = 10,
    ) -> tuple[int, list[VoiceRow]]:
        """Voices the tenant may see (its own plus public ones), filtered and paginated."""
        query = select(VoiceRow)
        if own_only:
            query = query.where(VoiceRow.tenant == visible_to)
        else:
            query = query.where((VoiceRow.tenant == visible_to) | (VoiceRow.visibility == "public"))
        if author_id:
            query = query.where(VoiceRow.tenant == author_id)
        if title:
            query = query.where(VoiceRow.title.contains(title))
        order = {
            "created_at": VoiceRow.created_at.desc(),
            "score": VoiceRow.task_count.desc(),
            "task_count": VoiceRow.task_count.desc(),
        }.get(sort_by, VoiceRow.task_count.desc())
        query = query.order_by(order, VoiceRow.created_at.desc())
        with self.sessions() as session:
            rows = list(session.scalars(query))
        # Tag and language filters run on the JSON lists in Python: portable across databases.
        if tags:
            rows = [row for row in rows if set(tags) <= set(row.tags or [])]
        if languages:
            rows = [row for row in rows if set(languages) & set(row.languages or [])]
        return len(rows), rows[offset : offset + limit]

    def update_voice(
        self, voice_id: str, cover_image: bytes | None = None, **fields: object
    ) -> VoiceRow | None:
        with self.sessions.begin() as session:
            row = session.get(VoiceRow, voice_id)
            if row is None:
                return None
            for name, value in fields.items():
                if value is not None:
                    setattr(row, name, value)
            old_cover = row.cover_image
            if cover_image:
                row.cover_image = f"voices/{voice_id}/cover-{uuid.uuid4().hex}"
                self.blobs.put(row.cover_image, cover_image)
            row.updated_at = utc_now()
        if cover_image and old_cover:
            self.blobs.delete(old_cover)
        return row

    def count_uses(self, uses: dict[str, int]) -> None:
        """Add each voice's new uses to its `task_count`, in one transaction (voices deleted
        meanwhile are skipped)."""
        with self.sessions.begin() as session:
            for voice_id, count in uses.items():
                row = session.get(VoiceRow, voice_id)
                if row is not None:
                    row.task_count = (row.task_count or 0) + count

    def delete_voice(self, voice_id: str) -> bool:
        with self.sessions.begin() as session:
            row = session.get(VoiceRow, voice_id)
            if row is None:
                return False
            keys = [key for sample in row.samples for key in (sample.audio_blob, sample.codes_blob)]
            if row.cover_image:
                keys.append(row.cover_image)
            session.delete(row)
        for key in keys:
            self.blobs.delete(key)
        return True

    def rename_voice(self, old_id: str, new_id: str, title: str) -> bool:
        """fish-speech's `/v1/references/update`: the voice moves to `new_id` with `title` (the
        reference's name). Blob keys keep the old id."""
        try:
            return self._rename_voice(old_id, new_id, title)
        except IntegrityError:  # a concurrent create or rename took new_id first
            return False

    def _rename_voice(self, old_id: str, new_id: str, title: str) -> bool:
        with self.sessions.begin() as session:
            row = session.get(VoiceRow, old_id)
            if row is None or session.get(VoiceRow, new_id) is not None:
                return False
            samples = [(s.position, s.text, s.audio_blob, s.codes_blob) for s in row.samples]
            fields = {c: getattr(row, c) for c in ("tenant", "description", "visibility", "tags")}
            fields |= {c: getattr(row, c) for c in ("languages", "cover_image", "task_count", "created_at")}
            session.delete(row)
            session.flush()
            new_row = VoiceRow(id=new_id, title=title, updated_at=utc_now(), **fields)
            for position, text, audio_key, codes_key in samples:
                new_row.samples.append(
                    SampleRow(
                        id=uuid.uuid4().hex,
                        position=position,
                        text=text,
                        audio_blob=audio_key,
                        codes_blob=codes_key,
                    )
                )
            session.add(new_row)
            return True

    def voice_codes(self, row: VoiceRow) -> list[tuple[str, np.ndarray]]:
        """(transcript, codes [N, T]) of each sample, in order."""
        return [(sample.text, codes_from_bytes(self.blobs.get(sample.codes_blob))) for sample in row.samples]

    def referenced_blobs(self) -> set[str]:
        """Every blob key a row names: voice samples and covers, job voices and item audio."""
        with self.sessions() as session:
            keys = set(session.scalars(select(SampleRow.audio_blob)))
            keys |= set(session.scalars(select(SampleRow.codes_blob)))
            keys |= set(session.scalars(select(VoiceRow.cover_image).where(VoiceRow.cover_image != "")))
            keys |= set(
                session.scalars(select(JobItemRow.audio_blob).where(JobItemRow.audio_blob.is_not(None)))
            )
            for references in session.scalars(select(JobRow.references)):
                keys |= {reference["codes_blob"] for reference in references or []}
        return keys

    def sweep_orphan_blobs(self, grace_seconds: float = ORPHAN_GRACE_SECONDS) -> int:
        """Remove blobs that no row names, as a crash leaves them: each blob is written before the
        row that names it commits (so a row never names a missing file), and a crash in between
        leaves the blob alone. Run at start-up; returns the files removed."""
        keep = self.referenced_blobs()
        return self.blobs.sweep(keep, time.time() - grace_seconds)

    def count_voices(self) -> int:
        with self.sessions() as session:
            return int(session.scalar(select(func.count()).select_from(VoiceRow)) or 0)

    # ---- bulk jobs ------------------------------------------------------------------------

    def create_job(
        self,
        tenant: str,
        options: dict,
        references: list[tuple[str, np.ndarray]],
        items: list[tuple[str, str]],
    ) -> JobRow:
        """A queued job with its items `(item_id, text)` in order; reference codes go to blobs."""
        job_id = "job_" + uuid.uuid4().hex
        stored_references = []
        for index, (text, codes) in enumerate(references):
            key = f"jobs/{job_id}/reference-{index}.npy"
            self.blobs.put(key, codes_to_bytes(codes))
            stored_references.append({"text": text, "codes_blob": key})
        row = JobRow(
            id=job_id,
            tenant=tenant,
            status="queued",
            options=options,
            references=stored_references,
            items_total=len(items),
        )
        item_rows = [
            JobItemRow(job_id=job_id, position=position, item_id=item_id, text=text)
            for position, (item_id, text) in enumerate(items)
        ]
        try:
            with self.sessions.begin() as session:
                session.add(row)
                session.flush()
                session.add_all(item_rows)
        except BaseException:
            for reference in stored_references:
                self.blobs.delete(reference["codes_blob"])
            raise
        return row

    def get_job(self, job_id: str) -> JobRow | None:
        with self.sessions() as session:
            return session.get(JobRow, job_id)

    def job_items(self, job_id: str) -> list[JobItemRow]:
        with self.sessions() as session:
            query = select(JobItemRow).where(JobItemRow.job_id == job_id).order_by(JobItemRow.position)
            return list(session.scalars(query))

    def job_item(self, job_id: str, item_id: str) -> JobItemRow | None:
        with self.sessions() as session:
            query = select(JobItemRow).where(JobItemRow.job_id == job_id, JobItemRow.item_id == item_id)
            return session.scalar(query)

    def list_jobs(self, tenant: str, offset: int = 0, limit: int = 10) -> tuple[int, list[JobRow]]:
        """The tenant's jobs, newest first."""
        with self.sessions() as session:
            total = session.scalar(select(func.count()).select_from(JobRow).where(JobRow.tenant == tenant))
            query = select(JobRow).where(JobRow.tenant == tenant)
            query = query.order_by(JobRow.created_at.desc(), JobRow.id).offset(offset).limit(limit)
            return int(total or 0), list(session.scalars(query))

    def count_active_jobs(self, tenant: str) -> int:
        query = select(func.count()).select_from(JobRow)
        query = query.where(JobRow.tenant == tenant, JobRow.status.in_(JOB_ACTIVE))
        with self.sessions() as session:
            return int(session.scalar(query) or 0)

    def active_job_ids(self, runner: str | None = None) -> list[str]:
        """Jobs with work left (queued or running), oldest first: what a restart resumes. With
        `runner`, only those it may run: without a live lease of another runner's."""
        query = select(JobRow.id).where(JobRow.status.in_(JOB_ACTIVE)).order_by(JobRow.created_at)
        if runner is not None:
            held_elsewhere = select(JobLeaseRow.job_id).where(
                JobLeaseRow.runner != runner, JobLeaseRow.expires_at >= utc_now()
            )
            query = query.where(JobRow.id.not_in(held_elsewhere))
        with self.sessions() as session:
            return list(session.scalars(query))

    def claim_job(self, job_id: str, runner: str, seconds: float) -> bool:
        """Take (or keep) the job's lease for `seconds` if no other runner holds a live one."""
        now = utc_now()
        until = now + dt.timedelta(seconds=seconds)
        takeover = update(JobLeaseRow).where(
            JobLeaseRow.job_id == job_id, or_(JobLeaseRow.runner == runner, JobLeaseRow.expires_at < now)
        )
        with self.sessions.begin() as session:
            if session.execute(takeover.values(runner=runner, expires_at=until)).rowcount > 0:
                return True
        try:
            with self.sessions.begin() as session:
                session.add(JobLeaseRow(job_id=job_id, runner=runner, expires_at=until))
        except IntegrityError:  # another runner's lease, live (or one it took just now)
            return False
        return True

    def renew_job_leases(self, runner: str, job_ids: set[str], seconds: float) -> set[str]:
        """Extend this runner's leases on `job_ids`; returns the ones it still holds (a lease that
        ran out and was taken over is lost: the runner must stop that job)."""
        if not job_ids:
            return set()
        held = (JobLeaseRow.runner == runner, JobLeaseRow.job_id.in_(job_ids))
        with self.sessions.begin() as session:
            until = utc_now() + dt.timedelta(seconds=seconds)
            session.execute(update(JobLeaseRow).where(*held).values(expires_at=until))
            return set(session.scalars(select(JobLeaseRow.job_id).where(*held)))

    def release_job(self, job_id: str, runner: str) -> None:
        with self.sessions.begin() as session:
            session.execute(
                delete(JobLeaseRow).where(JobLeaseRow.job_id == job_id, JobLeaseRow.runner == runner)
            )

    def set_job_status(
        self, job_id: str, status: str, error: str | None = None, only_if_active: bool = True
    ) -> bool:
        """Move a job to `status`; with `only_if_active` only from queued/running, so a job that
        was cancelled (or finished) meanwhile keeps its final state. Returns whether it moved."""
        now = utc_now()
        values: dict = {"status": status, "updated_at": now}
        if status not in JOB_ACTIVE:
            values["finished_at"] = now
        if error is not None:
            values["error"] = error
        query = update(JobRow).where(JobRow.id == job_id)
        if only_if_active:
            query = query.where(JobRow.status.in_(JOB_ACTIVE))
        with self.sessions.begin() as session:
            return session.execute(query.values(**values)).rowcount > 0

    def finish_job_item(
        self, job_id: str, position: int, audio: bytes, extension: str, seconds: float
    ) -> None:
        """Checkpoint one item: its audio blob first, then (one transaction) the item and the
        job's totals, so a crash between the two leaves the item pending, never half recorded."""
        key = f"jobs/{job_id}/{position}-{uuid.uuid4().hex}.{extension}"  # a retry never reuses a key
        self.blobs.put(key, audio)
        item_done = update(JobItemRow).where(
            JobItemRow.job_id == job_id, JobItemRow.position == position, JobItemRow.status != "done"
        )
        # Counters as SQL increments, not read-modify-write: a job's items finish concurrently.
        totals = update(JobRow).where(JobRow.id == job_id)
        totals = totals.values(
            items_done=JobRow.items_done + 1,
            audio_seconds=JobRow.audio_seconds + seconds,
            updated_at=utc_now(),
        )
        with self.sessions.begin() as session:
            if session.execute(
                item_done.values(status="done", audio_blob=key, audio_seconds=seconds)
            ).rowcount:
                session.execute(totals)
                return
        self.blobs.delete(key)  # the item was recorded already (or is gone)

    def mark_job_item_running(self, job_id: str, position: int) -> None:
        query = update(JobItemRow).where(
            JobItemRow.job_id == job_id, JobItemRow.position == position, JobItemRow.status == "pending"
        )
        with self.sessions.begin() as session:
            session.execute(query.values(status="running"))

    def reset_running_job_items(self, job_id: str) -> int:
        """Items left "running" by a runner that stopped or died go back to pending."""
        query = update(JobItemRow).where(JobItemRow.job_id == job_id, JobItemRow.status == "running")
        with self.sessions.begin() as session:
            return session.execute(query.values(status="pending")).rowcount

    def fail_job_item(self, job_id: str, position: int, error: str) -> None:
        with self.sessions.begin() as session:
            item = session.get(JobItemRow, (job_id, position))
            if item is not None and item.status != "done":
                item.status, item.error = "failed", error

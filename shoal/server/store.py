"""Durable state: API keys and voices in SQL (SQLite by default, any SQLAlchemy URL works), voice
audio and codec codes as blobs in a local directory. Nothing lives only in memory, so a restart
loses nothing.

All methods are synchronous (SQLAlchemy + file IO); async routes call them in a worker thread.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy import JSON, DateTime, ForeignKey, Integer, String, Text, create_engine, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, sessionmaker


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


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
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


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
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
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


class VoiceExistsError(ValueError):
    """A voice with this id exists already (the id is the name in fish-speech's routes)."""


class BlobStore:
    """Opaque byte blobs under one directory, addressed by relative keys like `voices/<id>/0.npy`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"blob key escapes the blob directory: {key!r}")
        return path

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(path.suffix + ".tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)  # atomic: a crash never leaves half a blob

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


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


class Store:
    """The SQL database and the blob directory behind keys and voices."""

    def __init__(self, database_url: str, blob_root: Path) -> None:
        connect_args = {"check_same_thread": False} if database_url.startswith("sqlite") else {}
        self.engine = create_engine(database_url, connect_args=connect_args, pool_pre_ping=True)
        Base.metadata.create_all(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.blobs = BlobStore(blob_root)

    @classmethod
    def in_directory(cls, data_dir: Path, database_url: str | None = None) -> Store:
        data_dir.mkdir(parents=True, exist_ok=True)
        url = database_url or f"sqlite:///{data_dir / 'shoal.db'}"
        return cls(url, data_dir / "blobs")

    def close(self) -> None:
        self.engine.dispose()

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

    def count_use(self, voice_id: str) -> None:
        with self.sessions.begin() as session:
            row = session.get(VoiceRow, voice_id)
            if row is not None:
                row.task_count = (row.task_count or 0) + 1

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

    def rename_voice(self, old_id: str, new_id: str) -> bool:
        """fish-speech's `/v1/references/update`: the id is the name there. Blob keys keep the old id."""
        try:
            return self._rename_voice(old_id, new_id)
        except IntegrityError:  # a concurrent create or rename took new_id first
            return False

    def _rename_voice(self, old_id: str, new_id: str) -> bool:
        with self.sessions.begin() as session:
            row = session.get(VoiceRow, old_id)
            if row is None or session.get(VoiceRow, new_id) is not None:
                return False
            samples = [(s.position, s.text, s.audio_blob, s.codes_blob) for s in row.samples]
            fields = {c: getattr(row, c) for c in ("tenant", "title", "description", "visibility", "tags")}
            fields |= {c: getattr(row, c) for c in ("languages", "cover_image", "task_count", "created_at")}
            session.delete(row)
            session.flush()
            new_row = VoiceRow(id=new_id, updated_at=utc_now(), **fields)
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

    def count_voices(self) -> int:
        with self.sessions() as session:
            return int(session.scalar(select(func.count()).select_from(VoiceRow)) or 0)

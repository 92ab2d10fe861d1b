"""Voices: the `/model` library the official clients manage, fish-speech's `/v1/references/*`
routes, and resolving a request's voice (stored id or inline samples) into encoded references.

A voice's audio is codec-encoded once, at upload; requests reuse the stored codes. Inline
references are encoded once per distinct clip and kept in a small in-memory cache. A voice's
use count (`task_count`) is written in batches, off the request's path: a request does not wait
for a database write before its first audio.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections import Counter, OrderedDict
from typing import Annotated, Literal

import anyio.to_thread
import numpy as np
import ormsgpack
from fastapi import APIRouter, Depends, File, Form, Path, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from shoal.engine.api import Engine, VoiceReference
from shoal.server import audio
from shoal.server.auth import Principal, require_principal
from shoal.server.errors import ApiError
from shoal.server.openapi import MSGPACK, body, errors, json_or_msgpack
from shoal.server.payload import MalformedPayload, check_unicode, decode_payload
from shoal.server.schemas import (
    MAX_PAGE_NUMBER,
    REFERENCE_ID_PATTERN,
    Author,
    DeletedVoice,
    ReferenceAudio,
    ReferenceDeleteBody,
    ReferenceRenameBody,
    ReferenceReply,
    Sample,
    TTSRequestBody,
    VoiceEntity,
    VoicePage,
)
from shoal.server.settings import ServerSettings
from shoal.server.store import NewSample, Store, VoiceExistsError, VoiceRow

log = logging.getLogger("shoal.server.voices")
VOICE_ID_PATTERN = re.compile(REFERENCE_ID_PATTERN)
INLINE_CACHE_SIZE = 256
STORED_CACHE_SIZE = 512
USE_FLUSH_SECONDS = 0.5  # how long a voice's new uses wait in memory before one write books them


def reference_voice_id(tenant: str, name: str) -> str:
    """The voice row of `tenant`'s fish-speech reference `name`. Those routes use names as ids;
    names are per tenant, so the row id is derived from both: one tenant's names can neither
    block nor reveal another's."""
    return "ref-" + hashlib.sha256(f"{tenant}\0{name}".encode()).hexdigest()[:40]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def can_use(principal: Principal, row: VoiceRow) -> bool:
    """Own voices, public and unlisted ones are usable; other tenants' private ones are not."""
    return row.tenant == principal.tenant or row.visibility in ("public", "unlist")


def voice_entity(row: VoiceRow) -> VoiceEntity:
    samples = [
        Sample(title=f"sample {s.position + 1}", text=s.text, task_id=s.id, audio="") for s in row.samples
    ]
    return VoiceEntity(
        _id=row.id,
        title=row.title,
        description=row.description or "",
        cover_image=row.cover_image or "",
        tags=list(row.tags or []),
        samples=samples,
        created_at=row.created_at,
        updated_at=row.updated_at,
        languages=list(row.languages or []),
        visibility=row.visibility,  # type: ignore[arg-type]
        task_count=row.task_count or 0,
        author=Author(_id=row.tenant, nickname=row.tenant),
    )


def entity_json(row: VoiceRow, status_code: int = 200) -> JSONResponse:
    return JSONResponse(voice_entity(row).model_dump(mode="json", by_alias=True), status_code=status_code)


# Appended to a synthesis request's missing voice: clients built for the cloud send its ids.
MISSING_VOICE_HINT = (
    "reference_id names a voice stored on this server: create one with POST /model or "
    "POST /v1/references/add; Fish cloud voice ids do not exist here"
)


class VoiceResolver:
    """Turns uploads into codes (once) and a request's voice fields into engine references."""

    def __init__(self, engine: Engine, store: Store, settings: ServerSettings) -> None:
        self.engine = engine
        self.store = store
        self.settings = settings
        self._inline: OrderedDict[str, np.ndarray] = OrderedDict()
        # Keyed by the samples' codes blobs, unique to each upload: a voice id can be reused (a
        # deleted voice's id taken again) and another API process may have done it, so the id
        # alone could name other samples than the ones cached here.
        self._stored: OrderedDict[tuple[str, ...], tuple[VoiceReference, ...]] = OrderedDict()
        self._uses: Counter[str] = Counter()  # voice id -> uses not yet written
        self._flush: asyncio.Task | None = None

    async def encode_upload(self, data: bytes) -> np.ndarray:
        """Decode an uploaded clip (in a thread) and codec-encode it with the engine."""
        if len(data) > self.settings.max_upload_bytes:
            raise ApiError(413, f"audio upload larger than {self.settings.max_upload_bytes} bytes")
        try:
            samples = await anyio.to_thread.run_sync(
                lambda: audio.decode_audio(data, max_seconds=self.settings.max_upload_seconds)
            )
        except audio.AudioDecodeError as error:
            raise ApiError(error.status, error.message) from error
        return await self.engine.encode_reference(samples, audio.SAMPLE_RATE)

    async def inline_references(self, references: list[ReferenceAudio]) -> tuple[VoiceReference, ...]:
        """Encode inline samples (cached by content hash)."""
        encoded = []
        for reference in references:
            digest = await anyio.to_thread.run_sync(sha256_hex, reference.audio)  # up to the upload cap
            codes = self._inline.get(digest)
            if codes is None:
                codes = await self.encode_upload(reference.audio)
                self._inline[digest] = codes
                while len(self._inline) > INLINE_CACHE_SIZE:
                    self._inline.popitem(last=False)
            else:
                self._inline.move_to_end(digest)
            encoded.append(VoiceReference(text=reference.text, codes=codes))
        return tuple(encoded)

    async def visible_voice(self, principal: Principal, voice_id: str) -> VoiceRow:
        row = await anyio.to_thread.run_sync(self.store.get_voice, voice_id)
        if row is None or not can_use(principal, row):
            raise ApiError(404, f"voice not found: {voice_id}")
        return row

    async def voice_for(self, principal: Principal, voice_id: str) -> VoiceRow:
        """A request's `reference_id`: the caller's own reference of that name, else a voice id
        it may use (a `/model` voice, or a reference made before names were per tenant, whose
        id is its name)."""
        own_id = reference_voice_id(principal.tenant, voice_id)
        own = await anyio.to_thread.run_sync(self.store.get_voice, own_id)
        return own if own is not None else await self.visible_voice(principal, voice_id)

    async def own_reference(self, principal: Principal, name: str) -> VoiceRow | None:
        row = await anyio.to_thread.run_sync(self.store.get_voice, reference_voice_id(principal.tenant, name))
        if row is None:  # a reference added before names were per tenant: its id is its name
            row = await anyio.to_thread.run_sync(self.store.get_voice, name)
            if row is not None and (row.tenant != principal.tenant or row.title != name):
                row = None
        return row

    async def stored_references(self, row: VoiceRow) -> tuple[VoiceReference, ...]:
        key = tuple(sample.codes_blob for sample in row.samples)
        cached = self._stored.get(key)
        if cached is None:
            pairs = await anyio.to_thread.run_sync(self.store.voice_codes, row)
            cached = tuple(VoiceReference(text=text, codes=codes) for text, codes in pairs)
            self._stored[key] = cached
            while len(self._stored) > STORED_CACHE_SIZE:
                self._stored.popitem(last=False)
        else:
            self._stored.move_to_end(key)
        self.count_use(row.id)
        return cached

    def count_use(self, voice_id: str) -> None:
        """Book one use of a voice: written with the others of the next `USE_FLUSH_SECONDS`."""
        self._uses[voice_id] += 1
        loop = asyncio.get_running_loop()
        # (a task of another loop, e.g. a test client's that has ended, would never run)
        if self._flush is None or self._flush.done() or self._flush.get_loop() is not loop:
            self._flush = loop.create_task(self._flush_later())

    async def _flush_later(self) -> None:
        """Write every `USE_FLUSH_SECONDS` while uses come in (also those booked during a write)."""
        while True:
            await asyncio.sleep(USE_FLUSH_SECONDS)
            try:
                await self.flush_uses()
            except Exception:  # a use count is not worth a request: log it and carry on
                log.exception("could not write the voices' use counts")
            if not self._uses:
                return

    async def flush_uses(self) -> None:
        """Write the uses booked so far (also at shutdown, so none is lost)."""
        uses, self._uses = self._uses, Counter()
        if uses:
            try:
                await anyio.to_thread.run_sync(self.store.count_uses, dict(uses))
            except BaseException:  # kept for the next write (a failure, or a shutdown mid-write)
                self._uses.update(uses)
                raise

    async def close(self) -> None:
        """Stop the pending write and make it now (the app's shutdown, before the store closes)."""
        flush, self._flush = self._flush, None
        if flush is not None and not flush.done():
            flush.cancel()
            if flush.get_loop() is asyncio.get_running_loop():
                with contextlib.suppress(asyncio.CancelledError):
                    await flush
        await self.flush_uses()

    async def resolve(self, principal: Principal, body: TTSRequestBody) -> tuple[VoiceReference, ...]:
        """The request's references: stored ids win over inline samples. Requests with equal
        references share the voice prefix's pages in the engine (it keys them by content)."""
        voice_ids = body.reference_ids()
        if voice_ids:
            references: list[VoiceReference] = []
            try:
                rows = [await self.voice_for(principal, voice_id) for voice_id in voice_ids]
            except ApiError as error:
                if error.status != 404:
                    raise
                raise ApiError(404, f"{error.message} ({MISSING_VOICE_HINT})") from error
            for row in rows:
                references.extend(await self.stored_references(row))
            return tuple(references)
        inline = body.flat_references()
        if inline:
            return await self.inline_references(inline)
        return ()


def resolver_of(request: Request) -> VoiceResolver:
    return request.app.state.voices


async def owned_voice(resolver: VoiceResolver, principal: Principal, voice_id: str) -> VoiceRow:
    """A voice the caller may modify: 404 if invisible to it, 403 if visible but not its own."""
    row = await resolver.visible_voice(principal, voice_id)
    if row.tenant != principal.tenant:
        raise ApiError(403, "this voice belongs to another account")
    return row


async def create_voice_row(
    resolver: VoiceResolver,
    principal: Principal,
    uploads: list[UploadFile],
    texts: list[str],
    **fields: object,
) -> VoiceRow:
    settings = resolver.settings
    if not uploads:
        raise ApiError(400, "at least one voice sample ('voices' file) is required")
    if len(uploads) > settings.max_voice_samples:
        raise ApiError(400, f"at most {settings.max_voice_samples} voice samples per voice")
    samples = []
    for index, upload in enumerate(uploads):
        if upload.size is not None and upload.size > settings.max_upload_bytes:
            raise ApiError(413, f"audio upload larger than {settings.max_upload_bytes} bytes")
        data = await upload.read()
        codes = await resolver.encode_upload(data)
        samples.append(NewSample(text=texts[index] if index < len(texts) else "", audio=data, codes=codes))
    # A voice the loaded model could never speak with is refused now, not at every use.
    voice = tuple(VoiceReference(text=sample.text, codes=sample.codes) for sample in samples)
    await anyio.to_thread.run_sync(resolver.engine.check_voice, voice)
    try:
        return await anyio.to_thread.run_sync(
            lambda: resolver.store.create_voice(principal.tenant, samples=samples, **fields)  # type: ignore[arg-type]
        )
    except VoiceExistsError as error:
        raise ApiError(409, str(error)) from error


router = APIRouter(tags=["voices"])
Principal_ = Annotated[Principal, Depends(require_principal)]
Resolver_ = Annotated[VoiceResolver, Depends(resolver_of)]


@router.post("/model", status_code=201, response_model=VoiceEntity, responses=errors(400, 401, 413, 422))
async def create_model(
    principal: Principal_,
    resolver: Resolver_,
    title: Annotated[str, Form(min_length=1, max_length=500)],
    voices: Annotated[list[UploadFile], File()],
    description: Annotated[str, Form()] = "",
    visibility: Annotated[Literal["public", "unlist", "private"], Form()] = "private",
    type: Annotated[Literal["tts"], Form()] = "tts",
    train_mode: Annotated[Literal["fast", "full"], Form()] = "fast",
    texts: Annotated[list[str], Form()] = [],  # noqa: B006 (FastAPI copies defaults)
    tags: Annotated[list[str], Form()] = [],  # noqa: B006
    cover_image: Annotated[UploadFile | None, File()] = None,
) -> JSONResponse:
    """Clone a voice from samples ("fast" mode: ready at once, state `trained`)."""
    cover = await cover_image.read() if cover_image is not None else None
    row = await create_voice_row(
        resolver,
        principal,
        voices,
        texts,
        title=title,
        description=description,
        visibility=visibility,
        tags=tags,
        cover_image=cover,
    )
    return entity_json(row, status_code=201)


@router.get("/model", response_model=VoicePage, responses=errors(401, 422))
async def list_models(
    principal: Principal_,
    resolver: Resolver_,
    page_size: Annotated[int, Query(ge=1, le=100)] = 10,
    page_number: Annotated[int, Query(ge=1, le=MAX_PAGE_NUMBER)] = 1,
    title: str | None = None,
    tag: Annotated[list[str], Query()] = [],  # noqa: B006 (FastAPI copies defaults)
    self_only: Annotated[bool, Query(alias="self")] = False,
    author_id: str | None = None,
    language: Annotated[list[str], Query()] = [],  # noqa: B006
    sort_by: Literal["score", "task_count", "created_at"] = "task_count",
) -> JSONResponse:
    """The caller's voices and everyone's public ones (unlisted voices are not listed to others)."""
    total, rows = await anyio.to_thread.run_sync(
        lambda: resolver.store.list_voices(
            visible_to=principal.tenant,
            own_only=self_only,
            title=title,
            tags=tag,
            languages=language,
            author_id=author_id,
            sort_by=sort_by,
            offset=(page_number - 1) * page_size,
            limit=page_size,
        )
    )
    page = VoicePage(
        total=total, items=[voice_entity(row) for row in rows], has_more=page_number * page_size < total
    )
    return JSONResponse(page.model_dump(mode="json", by_alias=True))


@router.get("/model/{voice_id}", response_model=VoiceEntity, responses=errors(401, 404))
async def get_model(voice_id: str, principal: Principal_, resolver: Resolver_) -> JSONResponse:
    return entity_json(await resolver.visible_voice(principal, voice_id))


@router.patch("/model/{voice_id}", response_model=VoiceEntity, responses=errors(400, 401, 403, 404, 413, 422))
async def update_model(
    voice_id: str,
    principal: Principal_,
    resolver: Resolver_,
    title: Annotated[str | None, Form(min_length=1, max_length=500)] = None,
    description: Annotated[str | None, Form()] = None,
    visibility: Annotated[Literal["public", "unlist", "private"] | None, Form()] = None,
    tags: Annotated[list[str] | None, Form()] = None,
    cover_image: Annotated[UploadFile | None, File()] = None,
) -> JSONResponse:
    await owned_voice(resolver, principal, voice_id)
    cover = await cover_image.read() if cover_image is not None else None
    row = await anyio.to_thread.run_sync(
        lambda: resolver.store.update_voice(
            voice_id,
            cover_image=cover,
            title=title,
            description=description,
            visibility=visibility,
            tags=tags,
        )
    )
    if row is None:
        raise ApiError(404, f"voice not found: {voice_id}")
    return entity_json(row)


@router.delete("/model/{voice_id}", response_model=DeletedVoice, responses=errors(401, 403, 404))
async def delete_model(voice_id: str, principal: Principal_, resolver: Resolver_) -> JSONResponse:
    await owned_voice(resolver, principal, voice_id)
    await anyio.to_thread.run_sync(resolver.store.delete_voice, voice_id)
    return JSONResponse({"_id": voice_id, "deleted": True})


# The media type of an uploaded sample, from its first bytes (uploads are stored as sent).
SAMPLE_SIGNATURES = (
    (b"RIFF", "audio/wav"),
    (b"OggS", "audio/ogg"),
    (b"fLaC", "audio/flac"),
    (b"ID3", "audio/mpeg"),
)
SAMPLE_MEDIA_TYPES = ("audio/wav", "audio/ogg", "audio/flac", "audio/mpeg", "application/octet-stream")


def sample_media_type(data: bytes) -> str:
    for signature, media_type in SAMPLE_SIGNATURES:
        if data.startswith(signature):
            return media_type
    if len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0:  # an MPEG audio frame sync
        return "audio/mpeg"
    return "application/octet-stream"


@router.get(
    "/model/{voice_id}/samples/{position}/audio",
    responses={
        200: {
            "description": "the sample's audio as it was uploaded",
            "content": {
                media: {"schema": {"type": "string", "format": "binary"}} for media in SAMPLE_MEDIA_TYPES
            },
        },
        **errors(401, 404, 422),
    },
)
async def sample_audio(
    voice_id: str, position: Annotated[int, Path(ge=0, le=1000)], principal: Principal_, resolver: Resolver_
) -> Response:
    """A voice's reference clip (position 0 is the first sample), for any voice the caller may use;
    the voices page plays it. A voice's `samples[].audio` is empty: the clip is served only here."""
    row = await resolver.visible_voice(principal, voice_id)
    sample = next((sample for sample in row.samples if sample.position == position), None)
    if sample is None:
        raise ApiError(404, f"voice {voice_id} has no sample {position}")
    try:
        data = await anyio.to_thread.run_sync(resolver.store.blobs.get, sample.audio_blob)
    except FileNotFoundError:  # deleted meanwhile
        raise ApiError(404, f"voice {voice_id} has no sample {position}") from None
    return Response(data, media_type=sample_media_type(data))


# ---- fish-speech's self-hosted reference routes ------------------------------------------------


def reference_reply(request: Request, payload: dict, status_code: int = 200) -> Response:
    """fish-speech answers msgpack unless the caller asks for JSON (`?format=json` or Accept)."""
    wants_json = request.query_params.get("format") == "json" or "json" in request.headers.get("accept", "")
    if wants_json:
        return JSONResponse(payload, status_code=status_code)
    return Response(ormsgpack.packb(payload), status_code=status_code, media_type="application/msgpack")


async def read_fields(request: Request) -> dict:
    """A small JSON, msgpack or form body as a dict (fish-speech accepts all three)."""
    content_type = request.headers.get("content-type", "")
    try:
        if "form" in content_type:
            data: object = dict(await request.form())
            check_unicode(data)
        else:
            body = await request.body()
            if not body:
                return dict(request.query_params)
            data = decode_payload(body, msgpack="msgpack" in content_type)
    except MalformedPayload as error:
        raise ApiError(400, str(error)) from error
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be an object")
    return data


def checked_reference_id(value: object) -> str:
    if not isinstance(value, str) or not VOICE_ID_PATTERN.match(value):
        raise ApiError(400, "reference id must be 1-64 letters, digits, '-' or '_'")
    return value


async def owned_reference(resolver: VoiceResolver, principal: Principal, name: str) -> VoiceRow:
    row = await resolver.own_reference(principal, name)
    if row is None:
        raise ApiError(404, f"reference not found: {name}")
    return row


@router.post(
    "/v1/references/add",
    responses={
        **json_or_msgpack(ReferenceReply, "the reference was added"),
        **errors(400, 401, 409, 413, 422),
    },
)
async def add_reference(
    request: Request,
    principal: Principal_,
    resolver: Resolver_,
    id: Annotated[str, Form()],
    audio: Annotated[UploadFile, File()],
    text: Annotated[str, Form()] = "",
) -> Response:
    name = checked_reference_id(id)
    if await resolver.own_reference(principal, name) is not None:
        raise ApiError(409, f"reference already exists: {name}")
    voice_id = reference_voice_id(principal.tenant, name)
    await create_voice_row(resolver, principal, [audio], [text], title=name, voice_id=voice_id)
    payload = {"success": True, "message": "reference added", "reference_id": name}
    return reference_reply(request, payload)


@router.get(
    "/v1/references/list", responses={**json_or_msgpack(ReferenceReply, "the caller's names"), **errors(401)}
)
async def list_references(request: Request, principal: Principal_, resolver: Resolver_) -> Response:
    """The caller's reference names (voices made by `/v1/references/add`)."""
    _, rows = await anyio.to_thread.run_sync(
        lambda: resolver.store.list_voices(visible_to=principal.tenant, own_only=True, limit=1_000_000)
    )
    names = sorted(
        row.title for row in rows if row.id in (reference_voice_id(principal.tenant, row.title), row.title)
    )
    return reference_reply(request, {"success": True, "reference_ids": names, "message": "ok"})


@router.delete(
    "/v1/references/delete",
    responses={**json_or_msgpack(ReferenceReply, "the reference was deleted"), **errors(400, 401, 404, 413)},
    openapi_extra=body(ReferenceDeleteBody, "application/json", MSGPACK, "application/x-www-form-urlencoded"),
)
async def delete_reference(request: Request, principal: Principal_, resolver: Resolver_) -> Response:
    name = checked_reference_id((await read_fields(request)).get("reference_id"))
    row = await owned_reference(resolver, principal, name)
    await anyio.to_thread.run_sync(resolver.store.delete_voice, row.id)
    return reference_reply(request, {"success": True, "message": "reference deleted", "reference_id": name})


@router.post(
    "/v1/references/update",
    responses={
        **json_or_msgpack(ReferenceReply, "the reference was renamed"),
        **errors(400, 401, 404, 409, 413),
    },
    openapi_extra=body(ReferenceRenameBody, "application/json", MSGPACK, "application/x-www-form-urlencoded"),
)
async def rename_reference(request: Request, principal: Principal_, resolver: Resolver_) -> Response:
    fields = await read_fields(request)
    old_name = checked_reference_id(fields.get("old_reference_id"))
    new_name = checked_reference_id(fields.get("new_reference_id"))
    row = await owned_reference(resolver, principal, old_name)
    if await resolver.own_reference(principal, new_name) is not None:
        raise ApiError(409, f"reference already exists: {new_name}")
    new_id = reference_voice_id(principal.tenant, new_name)
    if not await anyio.to_thread.run_sync(resolver.store.rename_voice, row.id, new_id, new_name):
        raise ApiError(409, f"reference already exists: {new_name}")
    payload = {
        "success": True,
        "message": "reference renamed",
        "old_reference_id": old_name,
        "new_reference_id": new_name,
    }
    return reference_reply(request, payload)

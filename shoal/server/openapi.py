"""The OpenAPI document as the server really behaves: request bodies of the routes that parse
their own (JSON or msgpack), every status a route answers with the Fish error body, audio and
msgpack media types, `Retry-After` on 429/503, and the bearer scheme when keys are required.

Routes declare what they answer with `responses=errors(...)` and `openapi_extra=body(...)`;
`install_openapi(app, auth)` adds the body models to the components and, without auth, drops
the security requirements (a `--no-auth` server accepts every request).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.security import HTTPBearer
from pydantic import BaseModel

from shoal.server.audio import CONTENT_TYPES

# The bearer scheme of `auth.require_principal`: the API key as `Authorization: Bearer <key>`.
bearer_scheme = HTTPBearer(
    auto_error=False, scheme_name="ApiKey", description="an API key from `shoal keys create`"
)

MSGPACK = "application/msgpack"


class ErrorBody(BaseModel):
    """Every error: exactly these two keys (the official clients build exceptions from them)."""

    status: int
    message: str


ERROR_MEANINGS = {
    400: "The request cannot be served as sent (bad audio, empty text, malformed body, ...)",
    401: "No API key, or an unknown one",
    403: "The resource belongs to another account",
    404: "No such resource (or not visible to this account)",
    409: "Conflicts with the current state (a name in use, an item not finished)",
    413: "Body, upload or text over the server's limit",
    422: "A field has the wrong type or is out of range",
    429: "Too many concurrent streams or unfinished jobs for this key",
    500: "The server failed",
    503: "At capacity: retry after the Retry-After seconds",
}
RETRY_AFTER_HEADER = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}
}

# Registered by `component()`, added to the components by `install_openapi()`.
_BODY_MODELS: dict[str, type[BaseModel]] = {}
ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorBody"}


def component(model: type[BaseModel]) -> dict[str, str]:
    """A reference to `model`'s schema, which `install_openapi` adds to the components."""
    _BODY_MODELS[model.__name__] = model
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these statuses, each with the Fish error body."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorBody, "description": ERROR_MEANINGS[status]}
        if status in (429, 503):
            entry["headers"] = RETRY_AFTER_HEADER
        responses[status] = entry
    return responses


def body(model: type[BaseModel], *media_types: str) -> dict[str, Any]:
    """`openapi_extra=` for a route that reads its own body: `model` in each media type
    (default JSON and msgpack)."""
    schema = component(model)
    types = media_types or ("application/json", MSGPACK)
    return {"requestBody": {"required": True, "content": {media: {"schema": schema} for media in types}}}


def audio_response(description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 whose body is an audio file in one of the formats' media types."""
    binary = {"schema": {"type": "string", "format": "binary"}}
    return {200: {"description": description, "content": {media: binary for media in CONTENT_TYPES.values()}}}


def json_or_msgpack(model: type[BaseModel], description: str, status: int = 200) -> dict[int | str, Any]:
    """fish-speech's reference routes: msgpack unless the caller asks for JSON."""
    schema = component(model)
    return {
        status: {
            "description": description,
            "content": {MSGPACK: {"schema": schema}, "application/json": {"schema": schema}},
        }
    }


def install_openapi(app: FastAPI, auth: bool) -> None:
    """Replace `app.openapi` with the generator described above."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(
            title=app.title, version=app.version, summary=app.summary, description=app.description,
            routes=app.routes,
        )  # fmt: skip
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name, model in _BODY_MODELS.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[name] = schema
        # FastAPI declares its own validation body for 422; this server answers the Fish one.
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        fish_422 = {
            "description": ERROR_MEANINGS[422],
            "content": {"application/json": {"schema": ERROR_SCHEMA}},
        }
        for operations in document["paths"].values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if "422" in responses:
                    responses["422"] = fish_422
                if not auth:
                    operation.pop("security", None)
                    responses.pop("401", None)
        if not auth:
            document["components"].pop("securitySchemes", None)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]

"""API keys and tenants (per-key stream limits: `shoal.server.limits`).

A key is `shoal_<random>`; only its SHA-256 is stored. Every request carries
`Authorization: Bearer <key>`; the key names a tenant (voices belong to tenants) and a default
priority. With `--no-auth` every caller is the `local` tenant.

Browsers cannot set headers on a WebSocket handshake, so a browser's live socket carries the key
in its offered subprotocols instead: `shoal.live` plus `shoal.key.<the key, base64url>`. The
server selects `shoal.live` and never echoes the key, which stays out of URLs (and so out of
proxy and access logs). The official clients send the header and offer no subprotocol.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
from dataclasses import dataclass
from typing import Annotated

import anyio.to_thread
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials
from starlette.requests import HTTPConnection

from shoal.engine.api import Priority
from shoal.server.errors import ApiError
from shoal.server.openapi import bearer_scheme
from shoal.server.store import Store

KEY_PREFIX = "shoal_"
LOCAL_TENANT = "local"
BROWSER_SUBPROTOCOL = "shoal.live"  # what the server selects for a browser's live socket
KEY_SUBPROTOCOL_PREFIX = "shoal.key."  # + the key in base64url, any padding dropped


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant that owns voices, the key (for stream limits) and its priority."""

    tenant: str
    key_id: str
    priority: Priority = Priority.STANDARD
    max_streams: int | None = None  # None: the server-wide default


def bearer_token(connection: HTTPConnection) -> str | None:
    header = connection.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return subprotocol_key(connection)
    return token.strip()


def offered_subprotocols(connection: HTTPConnection) -> list[str]:
    """The subprotocols a WebSocket handshake offers (none for an HTTP request)."""
    if connection.scope["type"] != "websocket":
        return []
    return list(connection.scope.get("subprotocols", ()))


def subprotocol_key(connection: HTTPConnection) -> str | None:
    """A browser's key, from its `shoal.key.<base64url>` subprotocol; undecodable: no key that any
    row matches, so the caller gets the same 401 as for a wrong key."""
    for offered in offered_subprotocols(connection):
        if offered.startswith(KEY_SUBPROTOCOL_PREFIX):
            encoded = offered.removeprefix(KEY_SUBPROTOCOL_PREFIX)
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return encoded
    return None


async def authenticate(connection: HTTPConnection) -> Principal:
    """Resolve the caller of an HTTP request or WebSocket handshake, or raise 401."""
    state = connection.app.state
    if not state.settings.auth:
        return Principal(tenant=LOCAL_TENANT, key_id=LOCAL_TENANT)
    token = bearer_token(connection)
    if token is None:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'")
    store: Store = state.store
    row = await anyio.to_thread.run_sync(store.find_key, hash_api_key(token))
    if row is None:
        raise ApiError(401, "Invalid Token")
    priority = Priority.BATCH if row.priority == "batch" else Priority.STANDARD
    return Principal(tenant=row.tenant, key_id=row.id, priority=priority, max_streams=row.max_streams)


async def require_principal(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)] = None,
) -> Principal:
    """FastAPI dependency: every route except health and metrics takes it. The bearer scheme
    only documents the header in the OpenAPI document; `authenticate` reads it."""
    principal = await authenticate(request)
    request.state.principal = principal
    return principal


def request_priority(principal: Principal, header_value: str | None) -> Priority:
    """`/v1/tts` priority: standard, or batch when the key says so or the caller asks
    (`x-shoal-priority: batch`). A caller can lower its priority, never raise it."""
    if principal.priority == Priority.BATCH or (header_value or "").strip().lower() in ("batch", "bulk"):
        return Priority.BATCH
    return Priority.STANDARD

"""schemathesis hooks for `test_openapi_fuzz.py` (loaded through SCHEMATHESIS_HOOKS): msgpack
bodies as the official SDKs send them, and msgpack replies decoded so their schemas are checked."""

from __future__ import annotations

import ormsgpack
import schemathesis


@schemathesis.serializer("application/msgpack")
def to_msgpack(ctx, value) -> bytes:
    return ormsgpack.packb(value)


@schemathesis.deserializer("application/msgpack")
def from_msgpack(ctx, response):
    return ormsgpack.unpackb(response.content)

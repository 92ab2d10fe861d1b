"""schemathesis hooks for `test_openapi_fuzz.py` (loaded through SCHEMATHESIS_HOOKS): msgpack
bodies as the official SDKs send them, and msgpack replies decoded so their schemas are checked."""

from __future__ import annotations

import ormsgpack
import schemathesis


def out_of_msgpack_range(value: int) -> str:
    """msgpack has no integers beyond 64 bits, so no msgpack client can send one; the generator
    draws them for free-form fields: they go as their decimal text."""
    return str(value)


@schemathesis.serializer("application/msgpack")
def to_msgpack(ctx, value) -> bytes:
    return ormsgpack.packb(value, default=out_of_msgpack_range, option=ormsgpack.OPT_PASSTHROUGH_BIG_INT)


@schemathesis.deserializer("application/msgpack")
def from_msgpack(ctx, response):
    return ormsgpack.unpackb(response.content)

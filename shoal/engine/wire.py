"""The wire format between API processes and the engine process: msgpack (ormsgpack) maps.

Every message is one ZeroMQ frame holding a msgpack map with a `type` key (the message kinds
are listed in `shoal.engine.process`). The API's dataclasses travel as maps of their fields,
read and written through `dataclasses.fields`, so a field added to or removed from the API
needs no change here; a field the receiving side does not know is dropped. Arrays travel as
raw bytes plus shape and dtype (no pickle, no per-element msgpack cost). Errors travel as the
exception's class name and message and come back as the same API class.

Plain data and numpy only: an API process imports this without torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import ormsgpack

from shoal.engine.api import (
    AudioChunk,
    EngineError,
    EngineOverloaded,
    EngineStats,
    FinishReason,
    InvalidRequest,
    Priority,
    SamplingOptions,
    SynthesisRequest,
    VoiceReference,
)

# Exceptions re-raised as themselves on the client; any other kind becomes an EngineError.
ERROR_KINDS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (EngineError, EngineOverloaded, InvalidRequest)
}


class ProtocolError(EngineError):
    """A message that is not a map with a known `type` and the keys that type needs."""


def pack(message: Mapping[str, Any]) -> bytes:
    return ormsgpack.packb(message)


def unpack(data: bytes) -> dict[str, Any]:
    try:
        message = ormsgpack.unpackb(data)
    except (ormsgpack.MsgpackDecodeError, ValueError) as error:
        raise ProtocolError(f"malformed message: {error}") from error
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("a message must be a map with a string 'type'")
    return message


# Arrays ------------------------------------------------------------------------------------


def encode_array(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array)
    return {"data": array.tobytes(), "shape": list(array.shape), "dtype": array.dtype.str}


def decode_array(data: Mapping[str, Any]) -> np.ndarray:
    """A writable array (a copy of the message's bytes: consumers may scale audio in place)."""
    dtype = np.dtype(data["dtype"])
    if dtype.hasobject:
        raise ProtocolError("object arrays are not accepted")
    return np.frombuffer(data["data"], dtype=dtype).reshape(data["shape"]).copy()


# Dataclasses -------------------------------------------------------------------------------


def plain_fields(value: Any) -> dict[str, Any]:
    """A dataclass instance as a map of its fields (values as they are)."""
    return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}


def construct(cls: type, data: Mapping[str, Any], **overrides: Any) -> Any:
    """`cls(**data)` keeping only the fields `cls` has (the other side may be a newer version)."""
    names = {field.name for field in dataclasses.fields(cls)}
    values = {key: value for key, value in data.items() if key in names}
    values.update(overrides)
    return cls(**values)


def encode_references(references: tuple[VoiceReference, ...]) -> list[dict[str, Any]]:
    return [{**plain_fields(reference), "codes": encode_array(reference.codes)} for reference in references]


def decode_references(data: list[Mapping[str, Any]]) -> tuple[VoiceReference, ...]:
    return tuple(construct(VoiceReference, item, codes=decode_array(item["codes"])) for item in data)


def encode_request(request: SynthesisRequest) -> dict[str, Any]:
    data = plain_fields(request)
    data["references"] = encode_references(request.references)
    data["sampling"] = plain_fields(request.sampling)
    data["priority"] = int(request.priority)
    return data


def decode_request(data: Mapping[str, Any]) -> SynthesisRequest:
    overrides: dict[str, Any] = {}
    if "references" in data:
        overrides["references"] = decode_references(data["references"])
    if "sampling" in data:
        overrides["sampling"] = construct(SamplingOptions, data["sampling"])
    if "priority" in data:
        overrides["priority"] = Priority(data["priority"])
    return construct(SynthesisRequest, data, **overrides)


def encode_chunk(chunk: AudioChunk) -> dict[str, Any]:
    samples = np.ascontiguousarray(chunk.samples, dtype=np.float32)
    data = plain_fields(chunk)
    data["samples"] = samples.tobytes()
    data["frames"] = None if chunk.frames is None else encode_array(np.asarray(chunk.frames, dtype=np.int32))
    return data


def decode_chunk(data: Mapping[str, Any]) -> AudioChunk:
    samples = np.frombuffer(data["samples"], dtype=np.float32).copy()
    frames = data.get("frames")
    return construct(
        AudioChunk, data, samples=samples, frames=None if frames is None else decode_array(frames)
    )


def encode_stats(stats: EngineStats) -> dict[str, Any]:
    return plain_fields(stats)


def decode_stats(data: Mapping[str, Any]) -> EngineStats:
    stats = construct(EngineStats, data)
    return dataclasses.replace(stats, queue_wait_buckets=tuple(stats.queue_wait_buckets))


def encode_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def decode_reason(value: str | None) -> FinishReason | None:
    return None if value is None else FinishReason(value)


# Errors ------------------------------------------------------------------------------------


def encode_error(error: BaseException) -> dict[str, str]:
    return {"kind": type(error).__name__, "message": str(error)}


def decode_error(data: Mapping[str, Any], kinds: Mapping[str, type[Exception]] = ERROR_KINDS) -> Exception:
    """The exception to raise on the client: the same class for the kinds in `kinds`, else an
    EngineError naming the engine-side class (the server answers 500 for it)."""
    kind, message = str(data.get("kind", "EngineError")), str(data.get("message", ""))
    cls = kinds.get(kind)
    if cls is not None:
        return cls(message)
    return EngineError(f"{kind}: {message}" if message else kind)


__all__ = [
    "ERROR_KINDS",
    "ProtocolError",
    "construct",
    "decode_array",
    "decode_chunk",
    "decode_error",
    "decode_reason",
    "decode_references",
    "decode_request",
    "decode_stats",
    "encode_array",
    "encode_chunk",
    "encode_error",
    "encode_reason",
    "encode_references",
    "encode_request",
    "encode_stats",
    "pack",
    "plain_fields",
    "unpack",
]

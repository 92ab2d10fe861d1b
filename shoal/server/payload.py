"""Request payloads as the clients send them: msgpack (the SDKs) or JSON, decoded into plain
data that is valid Unicode throughout.

JSON may carry a lone UTF-16 surrogate (`"\\ud800"`), which Python decodes into a `str` that
no encoder, tokenizer or database accepts; it is refused here, once, for every route.
"""

from __future__ import annotations

import json

import ormsgpack


class MalformedPayload(ValueError):
    """The bytes are not a valid msgpack or JSON document of valid Unicode text."""


def decode_payload(raw: bytes | str, msgpack: bool) -> object:
    """`raw` as msgpack (when `msgpack`) or JSON; MalformedPayload says what is wrong."""
    kind = "msgpack" if msgpack else "JSON"
    try:
        data = ormsgpack.unpackb(raw) if msgpack else json.loads(raw)
    except (ValueError, RecursionError, ormsgpack.MsgpackDecodeError) as error:  # RecursionError: nesting
        raise MalformedPayload(f"malformed {kind} body: {error}") from error
    check_unicode(data)
    return data


def check_unicode(data: object) -> None:
    """Raise MalformedPayload if any string (key or value) holds a lone surrogate."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not is_valid_unicode(value):
                raise MalformedPayload(
                    f"{path or 'body'}: text is not valid Unicode (a lone UTF-16 surrogate)"
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                label = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not is_valid_unicode(key):
                    raise MalformedPayload(f"{path or 'body'}: a key is not valid Unicode")
                stack.append((item, label))
        elif isinstance(value, list | tuple):
            stack.extend((item, f"{path}[{index}]") for index, item in enumerate(value))


def is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

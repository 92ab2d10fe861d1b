"""Every failure leaves the server as the Fish error body: exactly `{"status": int, "message": str}`.

The legacy client builds its exception with `HttpCodeErr(**body)`, so any extra key breaks it,
and the new client crashes on a JSON list (FastAPI's default 422 body). Every handler here
therefore answers a two-key JSON object, whatever went wrong.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from shoal.engine.api import EngineOverloaded, EngineUnavailable, InvalidRequest

log = logging.getLogger("shoal.server")


class ApiError(Exception):
    """Raise anywhere in a route to answer `{"status", "message"}` with that status."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after  # seconds, for 429 and 503 (else the default)

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def error_body(status: int, message: str) -> dict[str, int | str]:
    return {"status": status, "message": message}


# 429 and 503 say when to come back (RFC 9110 Retry-After, whole seconds): a stream slot or
# queue room frees as soon as one request ends, so one second unless the refusal says more.
RETRY_STATUSES = (429, 503)
DEFAULT_RETRY_AFTER_SECONDS = 1
# The engine process is gone or restarting: a restart takes seconds (the demo) to minutes (a GPU
# checkpoint's load and graph capture), so clients come back later than for a full queue.
ENGINE_UNAVAILABLE_RETRY_AFTER_SECONDS = 5


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if status in RETRY_STATUSES and not any(name.lower() == "retry-after" for name in headers):
        headers["Retry-After"] = str(DEFAULT_RETRY_AFTER_SECONDS)
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def describe_validation_error(errors: list[dict]) -> str:
    """One readable line from pydantic's error list, e.g. `body.chunk_length: Input should be ...`."""
    parts = []
    for error in errors[:5]:
        location = ".".join(str(item) for item in error.get("loc", ()) if item not in ("body",))
        message = error.get("msg", "invalid value")
        parts.append(f"{location}: {message}" if location else message)
    return "invalid request: " + "; ".join(parts)


def exception_to_error(exc: BaseException) -> ApiError:
    """Map engine and validation exceptions to an ApiError (used by HTTP and WebSocket routes)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineOverloaded):
        return ApiError(503, f"server is at capacity, retry later ({exc})")
    if isinstance(exc, EngineUnavailable):
        return ApiError(
            503, f"the engine is unavailable, retry later ({exc})", ENGINE_UNAVAILABLE_RETRY_AFTER_SECONDS
        )
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc) or "invalid request")
    if isinstance(exc, ValidationError | RequestValidationError):
        return ApiError(422, describe_validation_error(list(exc.errors())))
    return ApiError(500, "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers so no route can leak FastAPI's default error bodies."""

    async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
        error = exception_to_error(exc)
        return error_response(error.status, error.message, error.headers)

    async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404 and message == "Not Found":
            message = f"no such endpoint: {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    async def handle_client_gone(request: Request, exc: Exception) -> JSONResponse:
        # The client left while its body was being read: nobody will see this answer, but the
        # request is counted (and logged by the server) as 499, not as an internal error.
        return error_response(499, "client closed the request")

    async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal server error")

    handled = (ApiError, EngineOverloaded, EngineUnavailable, InvalidRequest, RequestValidationError)
    for exc_type in (*handled, ValidationError):
        app.add_exception_handler(exc_type, handle_api_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_exception)
    app.add_exception_handler(ClientDisconnect, handle_client_gone)
    app.add_exception_handler(Exception, handle_unexpected)

"""Errors in each route's dialect, and the handlers that render every failure through them.

TEI routes answer ``{"error": "...", "error_type": "..."}``; /v1 routes answer OpenAI's
``{"error": {"message", "type", "code"}}`` so the OpenAI SDK raises its usual exceptions. The
invariants: every failure a client can cause leaves the server as one of these bodies with a 4xx
status; only a model failure (500) or a dead worker (503) is 5xx, and a 5xx body never carries
exception text (it names the request id; the log line has the details). 429 and 503 always carry
``Retry-After``.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.http.request_id import request_id

log = logging.getLogger("radixserve.server")

# kind -> (status, TEI error_type, OpenAI type, OpenAI code)
KINDS: dict[str, tuple[int, str, str, str]] = {
    "empty": (400, "Empty", "invalid_request_error", "empty_input"),
    "wrong_model": (400, "Validation", "invalid_request_error", "wrong_model_type"),
    "unauthorized": (401, "Unauthorized", "authentication_error", "invalid_api_key"),
    "not_found": (404, "NotFound", "invalid_request_error", "not_found"),
    "model_not_found": (404, "NotFound", "invalid_request_error", "model_not_found"),
    "method": (405, "Validation", "invalid_request_error", "method_not_allowed"),
    "timeout": (408, "Timeout", "invalid_request_error", "request_timeout"),
    "too_large": (413, "PayloadTooLarge", "invalid_request_error", "payload_too_large"),
    "media_type": (415, "UnsupportedMediaType", "invalid_request_error", "unsupported_media_type"),
    "header_too_large": (431, "RequestHeaderFieldsTooLarge", "invalid_request_error", "request_header_too_large"),
    "validation": (422, "Validation", "invalid_request_error", "invalid_value"),
    "tokenizer": (422, "Tokenizer", "invalid_request_error", "tokenizer_error"),
    "overloaded": (429, "Overloaded", "rate_limit_error", "rate_limit_exceeded"),
    "backend": (500, "Backend", "server_error", "internal_error"),
    "unhealthy": (503, "Unhealthy", "server_error", "service_unavailable"),
}

# te_request_failure's `err` values: every kind an app answers and a client gone before its answer;
# a request head over the limits (header_too_large) is answered by the connection (server/http/
# connections.py) before any app sees the request, so it is not counted there.
FAILURE_LABELS = (frozenset(KINDS) - {"header_too_large"}) | {"client_gone"}

# Starlette/FastAPI HTTPException status -> our kind
HTTP_KINDS = {400: "validation", 401: "unauthorized", 404: "not_found", 405: "method", 408: "timeout",
              413: "too_large", 415: "media_type", 429: "overloaded", 503: "unhealthy"}

# Seconds a client should wait before retrying: permits free up within a batch or two; a server
# that is down or draining needs longer (or another replica).
RETRY_AFTER: dict[int, str] = {429: "1", 503: "5"}


@dataclass
class ApiError(Exception):
    """A failure to report to the client; ``kind`` is a key of KINDS."""

    kind: str
    message: str

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def status(self) -> int:
        return KINDS[self.kind][0]


def is_openai_path(path: str) -> bool:
    """/v1/... and the /embeddings alias speak the OpenAI dialect."""
    return path.startswith("/v1/") or path == "/embeddings"


def error_body(kind: str, message: str, *, path: str) -> dict:
    status, tei_type, oai_type, oai_code = KINDS[kind]
    if is_openai_path(path):
        return {"error": {"message": message, "type": oai_type, "param": None, "code": oai_code}}
    return {"error": message, "error_type": tei_type}


def error_headers(kind: str) -> dict[str, str]:
    """Headers every error of ``kind`` carries: Retry-After on 429/503, the auth scheme on 401."""
    status = KINDS[kind][0]
    headers = {}
    if status in RETRY_AFTER:
        headers["retry-after"] = RETRY_AFTER[status]
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    return headers


def error_response(kind: str, message: str, *, path: str) -> JSONResponse:
    return JSONResponse(error_body(kind, message, path=path), status_code=KINDS[kind][0], headers=error_headers(kind))


def error_bytes(kind: str, message: str, *, path: str) -> tuple[int, bytes]:
    """Status and JSON body bytes; raw ASGI senders should use ``send_error`` (it adds the headers)."""
    return KINDS[kind][0], json.dumps(error_body(kind, message, path=path)).encode()


async def send_error(send, kind: str, message: str, *, path: str, close: bool = False) -> None:
    """Send a whole error response on a raw ASGI ``send`` (middleware that runs before routing).

    ``close``: ask the client to drop the connection (after a body that was not read to its end).
    """
    status, body = error_bytes(kind, message, path=path)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error_headers(kind).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def internal_message(rid: str) -> str:
    """The whole 500 body text: no exception text reaches a client."""
    return f"internal error; request id {rid}"


def describe_errors(errors: Sequence[Mapping[str, Any]], *, prefix: str = "") -> str:
    """A one-line summary of pydantic's errors: ``body.dimensions: Input should be ...``."""
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in (prefix, *err.get("loc", ())) if p != "")
        msg = err.get("msg", "invalid")
        if err.get("type") == "json_invalid":
            msg = f"malformed JSON: {err.get('ctx', {}).get('error', msg)}"
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(errors) > 5:
        parts.append(f"... {len(errors) - 5} more")
    return "; ".join(parts) or "invalid request"


class ClientGone(Exception):
    """The client disconnected before its result was ready (answered 499, which nobody reads)."""


def describe_validation(exc: RequestValidationError) -> str:
    return describe_errors(list(exc.errors()))


def install_handlers(app: FastAPI, *, on_error=None) -> None:
    """Route every error through our bodies; ``on_error(kind)`` counts failures."""

    def note(kind: str) -> None:
        if on_error is not None:
            on_error(kind)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        note(exc.kind)
        return error_response(exc.kind, exc.message, path=request.url.path)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        note("client_gone")
        return Response(status_code=499)  # nobody reads it: the connection is closed

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        note("validation")
        return error_response("validation", describe_validation(exc), path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = HTTP_KINDS.get(exc.status_code, "validation")
        if exc.status_code >= 500 and kind != "unhealthy":
            kind = "backend"
        message = str(exc.detail)
        if kind == "backend":
            rid = request_id(request)
            log.error("HTTP %d on %s (request id %s): %s", exc.status_code, request.url.path, rid, message)
            message = internal_message(request_id(request))
        elif exc.status_code == 400:  # FastAPI could not decode the body (e.g. not UTF-8)
            message = f"could not parse the request body as UTF-8 JSON ({message})"
        note(kind)
        response = error_response(kind, message, path=request.url.path)
        for name, value in (exc.headers or {}).items():  # Allow on a 405
            response.headers.setdefault(name, value)
        return response

    @app.exception_handler(MemoryError)
    async def _memory(request: Request, exc: MemoryError) -> JSONResponse:
        # NOTE: an allocation failed for this request (an answer too big for what is left): it
        # fails alone, with a retryable 503; the server keeps serving.
        rid = request_id(request)
        log.error("out of memory on %s (request id %s)", request.url.path, rid)
        note("unhealthy")
        response = error_response("unhealthy", f"not enough memory for this request; retry later or send fewer "
                                  f"or shorter inputs (request id {rid})", path=request.url.path)
        response.headers["x-request-id"] = rid
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # NOTE: Starlette runs this handler outside every middleware, so FrontDoor cannot add the
        # x-request-id header here; the response sets it itself.
        rid = request_id(request)
        log.exception("unhandled error on %s (request id %s)", request.url.path, rid)
        note("backend")
        response = error_response("backend", internal_message(rid), path=request.url.path)
        response.headers["x-request-id"] = rid
        return response

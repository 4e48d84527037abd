"""The front door: ``FrontDoor``, the ASGI middleware every HTTP request passes first.

``FrontDoor`` is a raw ASGI middleware that runs before any route code. In order, for each HTTP
request it: assigns the request id (``x-request-id`` on every response); requires the API key on
every request that can do work (any method but GET/HEAD/OPTIONS, so routes added later are
covered by default; the GET routes only describe the server: /info, /health, /ping, /metrics,
/docs, /openapi.json, /v1/models); refuses a non-JSON Content-Type or any Content-Encoding but
identity (415); and reads the body,
refusing one over the payload limit (413, judged from Content-Length and again while reading, so
a chunked body cannot slip past) or one that does not arrive within ``body_timeout_s`` of the
headers (408). A request whose headers frame it ambiguously (``scope_framing_problem``: Content-
Length with Transfer-Encoding, a transfer coding other than chunked) gets a 400
and the connection closes; the connection refuses these before parsing (server/http/connections.py),
this check covers heads pipelined behind a request in work.
Per-item admission (429) is the service layer's (server/service/permits.py).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json

from scheduler import stages
from server.http import request_id
from server.http.deadline import receive_before
from server.http.framing import scope_framing_problem
from server.http.errors import error_body, send_error

OPEN_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # OPTIONS: CORS preflights carry no credentials
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def bearer_matches(header: bytes | None, key_digest: bytes) -> bool:
    """``Authorization: Bearer TOKEN`` with TOKEN equal (as UTF-8 bytes) to the key.

    Both sides are hashed first so the comparison takes the same time whatever the token's
    length or content; the header is never decoded (a latin-1 decode would make non-ASCII keys
    unmatchable).
    """
    if not header:
        return False
    scheme, _, token = header.strip().partition(b" ")
    token = token.strip(b" \t")
    if scheme.lower() != b"bearer" or not token:
        return False
    return hmac.compare_digest(hashlib.sha256(token).digest(), key_digest)


def json_content_type(value: bytes | None) -> str | None:
    """None when the Content-Type is acceptable, else the reason it is not.

    Accepted: application/json and application/*+json, charset UTF-8 or none; no header at all
    is read as JSON (a client that names no type still gets its body validated as JSON).
    """
    if value is None:
        return None
    media, *params = value.decode("latin-1").split(";")
    media = media.strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        hint = " (curl -d sends it: add -H 'Content-Type: application/json')" if "form" in media else ""
        return f"unsupported Content-Type {media or '(empty)'!r}{hint}; send application/json"
    for param in params:
        name, _, val = param.partition("=")
        if name.strip().lower() == "charset" and val.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return f"unsupported charset {val.strip()!r}; send UTF-8 JSON"
    return None


def content_encoding(value: bytes | None) -> str | None:
    """None when the body is not encoded (no Content-Encoding, or ``identity``), else the reason.

    Bodies are never decompressed: a compressed body would be judged against the payload limit
    by its compressed size, and a few KB of gzip can inflate to gigabytes.
    """
    if value is None:
        return None
    codings = [c.strip().lower() for c in value.decode("latin-1").split(",") if c.strip()]
    if all(c == "identity" for c in codings):
        return None
    return (f"unsupported Content-Encoding {value.decode('latin-1').strip()!r}: send the body uncompressed "
            "(the server does not decode request bodies)")


async def send_bad_request(send, message: str, path: str) -> None:
    """A 400 (``Validation``) in the route's dialect, closing the connection: the request's framing
    cannot be trusted, so nothing after it on the connection can be either."""
    body = json.dumps(error_body("validation", message, path=path)).encode()
    await send({"type": "http.response.start", "status": 400, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


BODY_STATE = "radixserve.body"  # the scope state key of the body the front door read whole


class FrontDoor:
    """ASGI middleware: request id, API key (401), Content-Type and -Encoding (415), payload limit
    (413) and body read timeout (408), each error in its route's dialect. With
    ``compute_tokens_header=False`` it leaves ``x-compute-tokens`` out of every response."""

    def __init__(
        self, app, *, payload_limit: int, api_key: str | None, body_timeout_s: float = 30.0, on_error=None,
        compute_tokens_header: bool = True,
    ) -> None:
        self.app = app
        self.payload_limit = payload_limit
        self.dropped = frozenset() if compute_tokens_header else frozenset({b"x-compute-tokens"})
        self.key_digest = hashlib.sha256(api_key.encode("utf-8")).digest() if api_key is not None else None
        self.body_timeout_s = body_timeout_s
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label = request_id.assign(scope)
        rid = label.encode("ascii")
        if stages.recorder is not None:  # opt-in stage stamps (benchmarks/bench_latency.py)
            stages.recorder("received", (label,))

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != b"x-request-id" and k.lower() not in self.dropped]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            if stages.recorder is not None and message["type"] == "http.response.body" \
                    and not message.get("more_body", False):
                stages.recorder("written", (label,))  # the last byte handed to the transport
            await send(message)

        await self._check(scope, receive, send_with_id)

    async def _check(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        method = scope.get("method", "GET")
        framing = scope_framing_problem(scope)
        if framing is not None:
            await send_bad_request(send, framing, path)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.key_digest is not None and method not in OPEN_METHODS:
            if not bearer_matches(headers.get(b"authorization"), self.key_digest):
                await self._reject(send, "unauthorized", "missing or wrong API key (Authorization: Bearer KEY)", path)
                return
        if method not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        # every Content-Encoding line counts (a later ``identity`` must not hide an earlier ``gzip``)
        codings = [v for k, v in scope.get("headers", []) if k.lower() == b"content-encoding"]
        problem = json_content_type(headers.get(b"content-type")) or content_encoding(
            b", ".join(codings) if codings else None)
        if problem is not None:
            await self._reject(send, "media_type", problem, path, close=True)
            return
        length = headers.get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                await self._reject(send, "validation", "invalid Content-Length header", path, close=True)
                return
            if int(length) > self.payload_limit:
                await self._reject(send, "too_large", self._too_large_message(), path, close=True)
                return
        body = await self._read_body(receive, send, path)
        if body is None:
            return
        scope["state"][BODY_STATE] = body  # the routes' parse reads it here (server/http/bodies.py)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        await self.app(scope, replay, send)

    async def _read_body(self, receive, send, path: str) -> bytes | None:
        """The whole body (bounded by the limit and the deadline), or None once answered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            try:
                # NOTE: one deadline for the whole body, not per chunk: a client that trickles a
                # byte every few seconds must not hold the connection forever.
                message = await receive_before(receive(), deadline)
            except asyncio.TimeoutError:
                message = f"the request body did not arrive within {self.body_timeout_s:g} s"
                await self._reject(send, "timeout", message, path, close=True)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.payload_limit:
                await self._reject(send, "too_large", self._too_large_message(), path, close=True)
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _too_large_message(self) -> str:
        return f"request body larger than the payload limit of {self.payload_limit} bytes"

    async def _reject(self, send, kind: str, message: str, path: str, *, close: bool = False) -> None:
        if self.on_error is not None:
            self.on_error(kind)
        await send_error(send, kind, message, path=path, close=close)

"""Admission control: the API key, the body-size limit and the per-item permits.

``Guard`` is a raw ASGI middleware that answers 401 (missing or wrong key on an inference
route) and 413 (a body over the limit, judged from Content-Length and again while reading, so a
chunked body cannot slip past) before any route code runs. ``Permits`` hands out one permit per
input item and never waits: when too few are left the request is refused at once (429), so
nothing queues behind an overloaded server.
"""
from __future__ import annotations

import hmac

from server.errors import error_bytes

# Inference routes; /info, /health, /metrics and the docs stay open.
PROTECTED = frozenset({"/embed", "/v1/embeddings", "/embeddings", "/rerank", "/v1/rerank", "/tokenize",
                       "/invocations", "/similarity", "/embed_all", "/decode", "/v1/embed", "/v2/embed",
                       "/v2/rerank"})
# POST / is inference (TEI's dispatch); GET / is TEI's open health check.
PROTECTED_POST = frozenset({"/"})


class Permits:
    """Non-blocking counting permits (event-loop confined: no lock needed)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.in_use = 0

    def try_acquire(self, n: int) -> bool:
        if self.in_use + n > self.total:
            return False
        self.in_use += n
        return True

    def release(self, n: int) -> None:
        self.in_use -= n
        assert self.in_use >= 0, "released more permits than acquired"


class Guard:
    """ASGI middleware: API key (401) and payload limit (413), in each route's dialect."""

    def __init__(self, app, *, payload_limit: int, api_key: str | None, on_error=None) -> None:
        self.app = app
        self.payload_limit = payload_limit
        self.api_key = api_key
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        protected = path in PROTECTED or (path in PROTECTED_POST and scope.get("method") == "POST")
        if self.api_key is not None and protected and not self._authorized(headers):
            await self._reject(send, "unauthorized", "missing or wrong API key (Authorization: Bearer KEY)", path)
            return
        length = headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.payload_limit
            except ValueError:
                await self._reject(send, "validation", "invalid Content-Length header", path)
                return
            if too_big:
                await self._reject(send, "too_large", self._too_large_message(), path)
                return
        # Read the whole body (bounded by the limit), then replay it to the app.
        chunks: list[bytes] = []
        size = 0
        more = scope.get("method") in ("POST", "PUT", "PATCH")
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.payload_limit:
                await self._reject(send, "too_large", self._too_large_message(), path)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def _too_large_message(self) -> str:
        return f"request body larger than the payload limit of {self.payload_limit} bytes"

    async def _reject(self, send, kind: str, message: str, path: str) -> None:
        if self.on_error is not None:
            self.on_error(kind)
        status, body = error_bytes(kind, message, path=path)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if kind == "unauthorized":
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

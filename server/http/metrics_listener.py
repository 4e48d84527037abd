"""The --prometheus-port listener's app: ``GET /metrics`` and ``GET /health``, nothing else.

A raw ASGI app served by a second uvicorn server on the API's event loop and HTTP protocol
(server/http/listener.py ``metrics_server``), so it has the API's request-head timeout and
connection cap and holds no thread per connection. It reads no request body: a request with one
gets its answer at once, and the connection is then held only until the head timeout.
Invariant: every answer is bounded and small (404 for any other path, 405 for any other method).
``/health`` here answers as the API's (200 with an empty body while the model worker runs and
the server is not draining, else 503): probes on this port keep their own connections, so slow
bodies or floods that fill the API port's connection cap cannot starve them (docs/operations.md).
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


def metrics_app(registry, *, on_scrape: Callable[[], None] | None = None,
                healthy: Callable[[], bool] | None = None):
    """ASGI app rendering ``registry`` on GET/HEAD /metrics (``on_scrape`` runs first), and
    /health when ``healthy`` is given."""
    paths = ("/metrics", "/health") if healthy is not None else ("/metrics",)

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        method = scope.get("method", "GET")
        path = scope.get("path")
        if path not in paths:
            await _plain(send, 404, b"not found: this listener serves GET " + " and ".join(paths).encode() + b" only\n")
        elif method not in ("GET", "HEAD"):
            await _plain(send, 405, b"method not allowed: GET " + path.encode() + b"\n", extra=[(b"allow", b"GET, HEAD")])
        elif path == "/health":
            ok = healthy is not None and healthy()
            await _plain(send, 200 if ok else 503, b"" if ok or method == "HEAD" else b"unhealthy\n",
                         extra=[] if ok else [(b"retry-after", b"5")])
        else:
            if on_scrape is not None:
                on_scrape()
            body = generate_latest(registry)
            await _plain(send, 200, b"" if method == "HEAD" else body, content_type=CONTENT_TYPE_LATEST.encode(),
                         length=len(body))

    return app


async def _plain(send, status: int, body: bytes, *, content_type: bytes = b"text/plain; charset=utf-8",
                 extra: list | None = None, length: int | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body) if length is None else length).encode()),
               *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

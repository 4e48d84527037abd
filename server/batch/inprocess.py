"""The in-process engine: the server's own app, driven without sockets, one request line at a time.

``Engine`` holds the app ``server.app.create_app`` builds (runner, scheduler, service, routes,
error handlers, front door) and dispatches each request line to it as one ASGI call: the line's
body goes through the same schema validation, tokenization, scheduler and runner as ``POST url``
on a running server, so a line's answer is the server's answer for the same body. What the app
does with HTTP (a socket, the HTTP parser, connection limits) is simply never used.

``async with Engine.build(config) as engine:`` runs the app's lifespan: the scheduler starts (and
warms up) on entry and is drained on exit. A failure on entry is ``StartFailed`` (the job reports
it in one line and exits 2). The app's start-up line names the address a server listens on;
offline nothing listens, so while the engine starts that line ends with where it runs instead.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from server.batch.lines import Request
from server.config import ServerConfig
from server.service.contract import ServedRunner


class StartFailed(RuntimeError):
    """The engine did not start (its cause: the scheduler's, the warm-up's or the app's error)."""


class OfflineStartupLine(logging.Filter):
    """Rewrites the app's "radixserve serving ... on HOST:PORT" line: a batch job listens nowhere."""

    PREFIX = "radixserve serving "

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.PREFIX) and not record.args:
            record.msg = record.msg.rsplit(" on ", 1)[0] + " in-process (batch job: nothing listens)"
        return True


@dataclass(frozen=True)
class Answer:
    """What the app answered one line."""

    status: int
    request_id: str
    body: bytes
    compute_tokens: int  # tokens the model computed for it (x-compute-tokens; 0 for a refused line)


@dataclass(frozen=True)
class Counters:
    """Token counters of the runs so far: N, N' and prefix-cache hits."""

    original: float  # tokens in the batches (N)
    compact: float  # rows the model ran on (N')
    cache_hit: float  # tokens read from the prefix cache

    def ratio(self) -> float:
        return self.compact / self.original if self.original else 1.0


class Engine:
    """One app, built once, answering request lines in-process."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.service = app.state.service
        self.metrics = self.service.metrics
        self._lifespan: contextlib.AbstractAsyncContextManager | None = None

    @classmethod
    def build(cls, config: ServerConfig, runner: ServedRunner | None = None) -> "Engine":
        """The app for ``config`` (``runner``: an already loaded one, else loaded from the config)."""
        from server.app import create_app

        return cls(create_app(config, runner=runner))

    async def __aenter__(self) -> "Engine":
        self._lifespan = self.app.router.lifespan_context(self.app)
        app_log, rewrite = logging.getLogger("radixserve.server"), OfflineStartupLine()
        app_log.addFilter(rewrite)
        try:
            await self._lifespan.__aenter__()
        except Exception as exc:  # noqa: BLE001 - whatever stops the start, the job reports it
            raise StartFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            app_log.removeFilter(rewrite)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._lifespan is not None
        await self._lifespan.__aexit__(*exc)

    @property
    def tokenizer(self) -> Any:
        return self.service.runner.tokenizer

    def encode_batch(self, texts: list[str]) -> list[Any]:
        """Token ids of ``texts`` without special tokens (grouping keys)."""
        return self.tokenizer.encode_batch(texts, add_special_tokens=False)

    def counters(self) -> Counters:
        registry = self.metrics.registry

        def value(name: str, labels: dict[str, str]) -> float:
            return registry.get_sample_value(name, labels) or 0.0

        return Counters(
            original=value("radixserve_tokens_total", {"kind": "original"}),
            compact=value("radixserve_tokens_total", {"kind": "compact"}),
            cache_hit=value("radixserve_prefix_cache_tokens_total", {"result": "hit"}),
        )

    async def call(self, request: Request) -> Answer:
        """``POST request.url`` with the line's body, answered by the app."""
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(request.body)).encode())]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": request.url, "raw_path": request.url.encode("utf-8", "replace"),
            "query_string": b"", "root_path": "", "headers": headers,
            "client": ("batch", 0), "server": ("batch", 0), "state": {},
        }
        sent = False
        never = asyncio.Event()  # the "client" never goes away: a line is always waited for

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await never.wait()
            return {"type": "http.disconnect"}

        status, out_headers, chunks = 500, {}, []

        async def send(message: dict) -> None:
            nonlocal status, out_headers
            if message["type"] == "http.response.start":
                status = int(message["status"])
                out_headers = {k.lower(): v for k, v in message.get("headers", ())}
            elif message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))

        await self.app(scope, receive, send)
        rid = out_headers.get(b"x-request-id", b"-").decode("ascii", "replace")
        computed = out_headers.get(b"x-compute-tokens", b"0")
        return Answer(status, rid, b"".join(chunks), int(computed) if computed.isdigit() else 0)


@contextlib.asynccontextmanager
async def started(config: ServerConfig, runner: ServedRunner | None = None) -> AsyncIterator[Engine]:
    """An engine for ``config`` with its scheduler running, for the block."""
    async with Engine.build(config, runner) as engine:
        yield engine

"""The process's life after start-up: drain on SIGTERM (or a dead model worker), then exit on time.

States: serving -> draining -> exit. ``Lifecycle.begin`` starts the drain: new requests get a JSON
503 with Retry-After (and ``connection: close``), /health turns 503 so probes take the replica out
of rotation, and requests already in flight may finish until ``grace - margin`` seconds after the
signal. What is still unanswered then is cancelled (its queued items leave the scheduler) and
answered with a JSON 503, never uvicorn's plain-text 500; then the HTTP server stops and the
scheduler is stopped with what time is left, so the process exits within ``grace`` seconds.
The exit status is 0 after a signal and ``EXIT_WORKER_DEAD`` when the model worker died, so
Docker's and Kubernetes' restart policies replace the process.

Invariant: every in-flight HTTP request is answered exactly once, by the app or by this module.
Everything here runs on the event loop except ``worker_died``, which is thread-safe.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from server.http.errors import error_bytes

log = logging.getLogger("radixserve.server")

EXIT_WORKER_DEAD = 70  # EX_SOFTWARE (sysexits.h): an internal failure; a supervisor should restart
# Open while draining: scrapers and dashboards may read them until the process is gone.
OPEN_WHILE_DRAINING = frozenset({"/metrics", "/info"})
RETRY_AFTER_S = 1


@dataclass
class _Call:
    """One in-flight HTTP request: whether its response began, and whether the drain cut it off."""

    started: bool = False
    expired: bool = False


class Lifecycle:
    """The drain state machine of one app; ``DrainGate`` tracks and answers its requests."""

    def __init__(self, *, grace_s: float) -> None:
        self.grace_s = grace_s
        # Reserve for answering cut-off requests, stopping the server and the scheduler.
        self.margin_s = min(2.0, 0.2 * grace_s)
        self.draining = False
        self.reason = ""
        self.exit_code = 0
        self.deadline: float | None = None  # time.monotonic() by which the process must be gone
        self.on_stop: Callable[[], None] | None = None  # set by the CLI: tells the HTTP server to shut down
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: dict[asyncio.Task, _Call] = {}
        self._task: asyncio.Task | None = None

    # -- triggers -------------------------------------------------------------------------------
    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def begin(self, reason: str, *, exit_code: int = 0) -> None:
        """Start draining (event loop). A second trigger only raises the exit code."""
        self.exit_code = max(self.exit_code, exit_code)
        if self.draining:
            return
        self.draining, self.reason = True, reason
        self.deadline = time.monotonic() + self.grace_s
        log.warning("draining (%s): no new requests; %d in flight get up to %.1f s, then a 503; exit within %.1f s",
                    reason, len(self._inflight), self.grace_s - self.margin_s, self.grace_s)
        self._task = asyncio.get_running_loop().create_task(self._drain())

    def worker_died(self, exc: BaseException) -> None:
        """The scheduler's on_death callback (any thread): drain and exit non-zero."""
        log.error("the model worker died (%s: %s): draining, then exiting with status %d",
                  type(exc).__name__, exc, EXIT_WORKER_DEAD)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(
                lambda: self.begin("the model worker died", exit_code=EXIT_WORKER_DEAD))

    def remaining(self) -> float:
        """Seconds left before the process must be gone (the full grace when not draining)."""
        return self.grace_s if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    # -- the drain ------------------------------------------------------------------------------
    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + self.grace_s - self.margin_s
        while self._inflight and loop.time() < until:
            await asyncio.sleep(0.02)
        late = [(t, c) for t, c in self._inflight.items() if not c.started]
        if late:
            log.warning("drain time is up: answering %d unfinished request(s) with 503", len(late))
        for task, call in late:
            call.expired = True
            task.cancel()
        until = loop.time() + self.margin_s / 4
        while self._inflight and loop.time() < until:
            await asyncio.sleep(0.01)
        if self.on_stop is not None:
            self.on_stop()


class DrainGate:
    """ASGI middleware: 503 for new requests while draining; tracks in-flight ones for the drain."""

    def __init__(self, app, *, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send) -> None:
        lifecycle = self.lifecycle
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if lifecycle.draining and path not in OPEN_WHILE_DRAINING:
            await _send_503(send, path, f"the server is shutting down ({lifecycle.reason}); retry another replica")
            return
        call = _Call()
        task = asyncio.current_task()
        assert task is not None, "ASGI calls run in a task"

        async def tracked_send(message) -> None:
            if message["type"] == "http.response.start":
                call.started = True
            await send(message)

        lifecycle._inflight[task] = call
        try:
            await self.app(scope, receive, tracked_send)
        except asyncio.CancelledError:
            if not call.expired:
                raise
            # The drain cut it off: answer here instead of uvicorn's plain-text 500.
            if hasattr(task, "uncancel"):  # 3.11+: the task is not "being cancelled" any more
                task.uncancel()
            if not call.started:
                await _send_503(send, path, "the server shut down before this request finished; retry")
        finally:
            lifecycle._inflight.pop(task, None)


async def _send_503(send, path: str, message: str) -> None:
    status, body = error_bytes("unhealthy", message, path=path)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

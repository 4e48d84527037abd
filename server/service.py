"""The request path shared by every inference route: checks, permits, submit, timings, metrics.

Order of checks (cheapest first, none of them queues anything): model kind (400), empty input
(400), too many inputs (422), worker alive (503), permits (429, at once); then tokenization (422
on bad input) and the scheduler. The invariants: permits taken for a request are given back on
every path out, including a client that disconnects while its items wait in the queue; a failure
inside the scheduler or model reaches the client as a generic body naming the request id, and
the log line with the same id has the details.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Sequence

from fastapi import Request

from scheduler import BatchFailed, WorkerDead
from server.admission import Permits
from server.errors import ApiError, internal_message
from server.request_id import request_id
from server.tokenize import Tokenization

log = logging.getLogger("radixserve.server")


class ClientGone(Exception):
    """The client disconnected before its result was ready."""


@dataclass(frozen=True)
class Limits:
    max_input_length: int
    max_client_batch_size: int
    auto_truncate: bool
    max_display_tokens: int = 16384  # tokens one /tokenize or /embed_all answer may hold (= max_batch_tokens)


@dataclass
class Served:
    """What a route needs to answer: one output per item and the timing headers."""

    outputs: list
    n_tokens: int
    headers: dict[str, str]


class Service:
    """Binds the runner, scheduler, tokenization, permits and metrics of one app."""

    def __init__(
        self,
        *,
        runner,
        scheduler,
        metrics,
        limits: Limits,
        permits: Permits,
        default_prompt_name: str | None = None,
        default_prompt: str | None = None,
        tokenization_workers: int = 2,
    ) -> None:
        self.runner = runner
        # The server's default prompt (flag) wins over the checkpoint's default_prompt_name.
        self.default_prompt = default_prompt
        self.default_prompt_name = default_prompt_name or getattr(runner, "default_prompt_name", None)
        self.scheduler = scheduler
        self.metrics = metrics
        self.limits = limits
        self.permits = permits
        self.tok = Tokenization(
            runner, max_input_length=limits.max_input_length, metrics=metrics, workers=tokenization_workers,
            max_display_tokens=limits.max_display_tokens,
        )

    # -- checks ---------------------------------------------------------------------------------
    def count(self, method: str) -> float:
        self.metrics.request_count.labels(method=method).inc()
        return time.perf_counter()

    def require(self, kind: str, route: str) -> None:
        if self.runner.kind != kind:
            other = "/rerank or /v1/rerank" if self.runner.kind == "reranker" else "/embed or /v1/embeddings"
            raise ApiError(
                "wrong_model",
                f"{route} needs a model of kind {kind!r}, but this server runs a model of kind "
                f"{self.runner.kind!r} ({self.runner.model_id}); use {other}",
            )

    def check_inputs(self, n: int, *, empty: bool, what: str = "inputs") -> None:
        if n == 0 or empty:
            raise ApiError("empty", f"{what} must not be empty")
        if n > self.limits.max_client_batch_size:
            raise ApiError(
                "validation",
                f"{n} {what} in one request, more than the maximum of {self.limits.max_client_batch_size}",
            )

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and not 1 <= dimensions <= self.runner.hidden_size:
            raise ApiError("validation", f"dimensions must lie in [1, {self.runner.hidden_size}], got {dimensions}")

    def truncate(self, requested: bool | None) -> bool:
        return self.limits.auto_truncate if requested is None else requested

    # -- the path -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def admitted(self, n_items: int):
        """Hold ``n_items`` permits for the block; 429 at once when too few are left."""
        if not self.permits.try_acquire(n_items):
            raise ApiError(
                "overloaded",
                f"too many concurrent inputs (limit {self.permits.total}, {self.permits.in_use} in flight); "
                "retry later",
            )
        try:
            yield
        finally:
            self.permits.release(n_items)

    async def serve(self, request: Request, *, method: str, start: float, n_items: int, make_items,
                    all_tokens: bool = False) -> Served:
        """Admit ``n_items``, build token ids with ``await make_items()``, run them, time them.

        ``all_tokens``: each output is the item's [L, E] per-token states instead of its pooled one.
        """
        if not self.scheduler.alive:
            rid = request_id(request)
            raise ApiError("unhealthy", f"the model worker is not running; retry later (request id {rid})")
        with self.admitted(n_items):
            items = await make_items()
            result = await self._submit(request, items, all_tokens=all_tokens)
        total = time.perf_counter() - start
        m = self.metrics
        m.request_duration.observe(total)
        m.queue_duration.observe(result.queue_time_s)
        m.inference_duration.observe(result.inference_time_s)
        m.request_success.labels(method=method).inc()
        headers = {
            "x-queue-time": _ms(result.queue_time_s),
            "x-inference-time": _ms(result.inference_time_s),
            "x-total-time": _ms(total),
            "x-compute-tokens": str(int(result.compute_tokens)),
        }
        return Served(list(result.outputs), sum(len(i) for i in items), headers)

    async def _submit(self, request: Request, items: Sequence[Sequence[int]], *, all_tokens: bool = False):
        """Await the scheduler; cancel the entries when the client goes away first."""
        rid = request_id(request)
        # NOTE: pooled calls keep the plain signature (schedulers injected by tests may not take all_tokens).
        extra = {"all_tokens": True} if all_tokens else {}
        work = asyncio.ensure_future(self.scheduler.submit([list(i) for i in items], request_id=rid, **extra))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                raise ClientGone()
            return work.result()
        except BatchFailed as exc:
            log.error("request id %s: %d items failed in the model: %s", rid, len(items), exc)
            raise ApiError("backend", internal_message(rid)) from exc
        except WorkerDead as exc:
            log.error("request id %s: the model worker is not available: %s", rid, exc)
            raise ApiError("unhealthy", f"the model worker is not available; retry later (request id {rid})") from exc
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # NOTE: the scheduler drops entries whose future was cancelled


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is already consumed)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _ms(seconds: float) -> str:
    return str(int(round(seconds * 1000)))

"""The Scheduler: the asyncio-facing front of the batching pipeline.

``submit`` runs on the event loop: it enqueues one entry per item (one request's items
contiguous) and awaits one future per item; the pipeline resolves them (``_resolve``, any thread)
through ``loop.call_soon_threadsafe``. Invariant: every future handed out is resolved exactly
once, by a result, BatchFailed, WorkerDead, or its own cancellation. The runner is any
``ModelRunner`` (scheduler/contract.py).

Client disconnects: cancellation is the mechanism. When the task awaiting ``submit`` is
cancelled (the server does that when the client goes away), its entries still waiting are
dropped (the runner never sees them); entries already in a batch run, and their results are
discarded. If a pipeline thread dies, the scheduler stops admitting, fails everything pending
with WorkerDead and calls ``on_death(exc)`` once.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, cast

from .contract import ModelRunner
from .forming import Entry, PrefixPolicy
from .metrics import Metrics
from .pipeline import Pipeline, WorkerDead
from .policy import make_former
from .waiting import QueueClosed, WaitQueue

log = logging.getLogger(__name__)


@dataclass
class SubmitResult:
    outputs: list  # one per item: float (a score), float32 [E] (pooled) or [L, E] (all_tokens)
    queue_time_s: float  # max over items of (forward start - enqueue)
    inference_time_s: float  # max over the batches the items were in
    compute_tokens: int  # tokens computed for the items (prefix-cache hits excluded)


class _Ticket:
    """Per-item bookkeeping carried in ``Entry.payload``; hashable by identity."""

    __slots__ = ("future", "loop", "label")

    def __init__(self, loop: asyncio.AbstractEventLoop, label: str) -> None:
        self.loop, self.label = loop, label
        self.future: asyncio.Future = loop.create_future()


def _ticket(entry: Entry) -> _Ticket:
    return cast(_Ticket, entry.payload)  # the scheduler alone makes entries, each with its ticket


def _resolve_future(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    """On the future's own loop: set its outcome unless it is done (cancelled by the client side)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


class Scheduler:
    """Token-budget batcher with a CPU-prep thread and a model-worker thread."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_batch_tokens: int,
        max_batch_requests: int | None = None,
        metrics: Metrics | None = None,
        policy: str = "fifo",
        prefix_policy: PrefixPolicy | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        warm_up: Callable[[], Any] | None = None,
    ) -> None:
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        if max_batch_requests is not None and max_batch_requests < 1:
            raise ValueError("max_batch_requests must be >= 1 or None")
        self.runner = runner
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        self._on_death_cb = on_death
        self._lock = threading.Lock()  # guards _pending, _accepting, _died; taken before the queue's
        self._pending: set[_Ticket] = set()
        self._accepting = self._started = self._died = False
        self._request_ids = itertools.count()
        if metrics is not None:
            metrics.batching_policy.labels(policy=policy).set(1)
        self._waiting = WaitQueue(on_size=metrics.queue_size.set if metrics is not None else None)
        former = make_former(policy, max_tokens=max_batch_tokens, max_requests=max_batch_requests, prefix=prefix_policy)
        self._pipeline = Pipeline(
            runner, self._waiting, former, metrics=metrics,
            resolve=lambda e, value, exc: self._resolve(_ticket(e), value, exc),
            label=lambda e: _ticket(e).label,
            on_death=self._on_death,
            warm_up=warm_up,
        )

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the threads; with a ``warm_up``, return once it ran on the worker thread (admitting
        only then), or raise if it failed (the worker is dead, ``on_death`` was called)."""
        with self._lock:
            if self._started:
                raise RuntimeError("Scheduler.start() called twice")
            self._started = True
        self._pipeline.start()
        self._pipeline.warmed.wait()
        if not self._pipeline.alive:
            self._pipeline.join(timeout=5.0)  # the threads exit once on_death has run
            raise RuntimeError("the model worker failed to warm up (the log has the cause)")
        with self._lock:
            self._accepting = not self._died

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop accepting; with ``drain`` finish queued work, else fail it with WorkerDead."""
        with self._lock:
            self._accepting = False
        for e in self._waiting.close(clear=not drain):
            self._resolve(_ticket(e), None, WorkerDead("the server is shutting down"))
        if self._started:
            self._pipeline.join(timeout)

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._accepting and self._pipeline.alive

    @property
    def queue_size(self) -> int:
        return self._waiting.size

    # -- resolving an item's future (any thread) ------------------------------------------------
    def _resolve(self, ticket: _Ticket, value: Any, exc: BaseException | None) -> None:
        with self._lock:
            self._pending.discard(ticket)
        try:
            ticket.loop.call_soon_threadsafe(_resolve_future, ticket.future, value, exc)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _on_death(self, exc: BaseException) -> None:
        with self._lock:
            if self._died:
                return
            self._died, self._accepting = True, False
            tickets = list(self._pending)
            self._pending.clear()
        self._waiting.close(clear=True)  # its entries' tickets are among the pending ones
        for t in tickets:
            self._resolve(t, None, WorkerDead("the model worker is not running"))
        if self._on_death_cb is not None:
            try:
                self._on_death_cb(exc)
            except Exception:  # noqa: BLE001 - the callback must not mask the death
                log.exception("the scheduler's on_death callback failed")

    def _cancel(self, tickets: list[_Ticket]) -> None:
        for t in tickets:
            if not t.future.done():
                t.future.cancel()
            elif not t.future.cancelled():
                t.future.exception()  # mark retrieved: no "never retrieved" noise
        gone = set(tickets)
        with self._lock:
            self._pending.difference_update(gone)
        self._waiting.discard(lambda e: e.payload in gone)

    # -- the event-loop side --------------------------------------------------------------------
    async def submit(
        self, items: list[list[int]], *, request_id: str | None = None, all_tokens: bool = False,
        namespace: bytes = b"",
    ) -> SubmitResult:
        """Run ``items`` (token id lists, each 1..max_batch_tokens long) and return their outputs.

        ``request_id`` names the request in the log lines of a failed batch. ``all_tokens``: each
        output is the item's per-token final states, float32 [L, E], instead of the pooled one.
        ``namespace``: the items' prefix-cache namespace (b"": shared); handed to ``runner.prepare``.
        """
        if not items:
            raise ValueError("submit needs at least one item")
        for i, ids in enumerate(items):
            if not 1 <= len(ids) <= self.max_batch_tokens:
                raise ValueError(f"item {i} has {len(ids)} tokens; allowed 1..{self.max_batch_tokens}")
        loop = asyncio.get_running_loop()
        rid = next(self._request_ids)
        label = request_id if request_id is not None else f"#{rid}"
        now = time.monotonic()
        tickets = [_Ticket(loop, label) for _ in items]
        entries = [Entry(rid, list(ids), now, payload=t, all_tokens=all_tokens, namespace=namespace)
                   for ids, t in zip(items, tickets)]
        with self._lock:
            if not (self._accepting and self._pipeline.alive):
                raise WorkerDead("the model worker is not running")
            try:
                self._waiting.push(entries)
            except QueueClosed:
                raise WorkerDead("the server is shutting down") from None
            self._pending.update(tickets)
        futures = [t.future for t in tickets]
        try:
            await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            for f in futures:  # the first failure in item order; all done when none failed
                if f.done() and (exc := f.exception()) is not None:
                    raise exc
        except BaseException:  # failure or cancellation: drop what is still queued
            self._cancel(tickets)
            raise
        results = [f.result() for f in futures]
        return SubmitResult(
            outputs=[r[0] for r in results],
            queue_time_s=max(r[1] for r in results),
            inference_time_s=max(r[2] for r in results),
            compute_tokens=sum(r[3] for r in results),
        )

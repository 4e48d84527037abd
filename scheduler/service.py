"""The Scheduler: the asyncio-facing front of the batching pipeline.

``submit`` runs on the event loop: it enqueues one entry per item (one request's items
contiguous, same request_id) and awaits one future per item; the worker thread resolves them
with ``loop.call_soon_threadsafe``. Invariant: every future handed out is settled exactly once,
by a result, BatchFailed, WorkerDead, or its own cancellation.

Client disconnects: cancellation is the mechanism. If the task awaiting ``submit`` is cancelled,
its entries still waiting are dropped (the runner never sees them); entries already in a
prepared batch run but their results are discarded. ``is_disconnected`` (Starlette's
``request.is_disconnected``, sync or async) is polled on the event loop, never from the
scheduler threads; when it reports True, the entries are cancelled the same way and submit
raises ``ClientDisconnected``.
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .forming import Entry, PrefixPolicy
from .metrics import Metrics
from .pipeline import BatchFailed, BatchTrace, Pipeline, PipelineConfig, WorkerDead
from .waiting import QueueClosed, WaitQueue


class ClientDisconnected(Exception):
    """``is_disconnected`` reported the client gone; the request's work was dropped."""


@dataclass
class SubmitResult:
    outputs: list  # np.ndarray [E] float32 per item (embeddings), float raw score (rerankers), or [L, E] (all_tokens)
    queue_time_s: float  # max over items of (forward start - enqueue)
    inference_time_s: float  # max over the batches the items were in
    compute_tokens: int  # total tokens of the items


class _Ticket:
    """Per-item bookkeeping carried in ``Entry.payload``; hashable by identity."""

    __slots__ = ("future", "loop", "cancelled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.cancelled = False


def _settle(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if fut.done():  # cancelled by the client side
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _default_build_index(input_ids: np.ndarray, position_ids: np.ndarray, cu_seqlens: np.ndarray):
    from .radix import build_index  # NOTE: lazy, so the scheduler imports without the builder

    return build_index(input_ids, position_ids, cu_seqlens)


class Scheduler:
    """Token-budget batcher with a CPU-prep thread and a model-worker thread."""

    def __init__(
        self,
        runner,
        *,
        max_batch_tokens: int,
        max_batch_requests: int | None,
        radix_threshold: float,
        metrics: Metrics | None = None,
        policy: str = "fifo",
        max_wait_s: float = 0.0,
        prefix_policy: PrefixPolicy | None = None,
        build_index: Callable[[np.ndarray, np.ndarray, np.ndarray], Any] | None = None,
        disconnect_poll_s: float = 0.1,
        trace_len: int = 256,
    ) -> None:
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        if max_batch_requests is not None and max_batch_requests < 1:
            raise ValueError("max_batch_requests must be >= 1 or None")
        self.runner = runner
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        self.disconnect_poll_s = disconnect_poll_s
        self._lock = threading.Lock()  # guards _pending, _accepting; taken before the queue's lock
        self._pending: set[_Ticket] = set()
        self._accepting = False
        self._started = False
        self._request_ids = itertools.count()
        on_size = metrics.queue_size.set if metrics is not None else None
        if metrics is not None:
            metrics.batching_policy.labels(policy=policy).set(1)
        self._waiting = WaitQueue(is_live=lambda e: not e.payload.cancelled, on_size=on_size)
        config = PipelineConfig(
            max_batch_tokens=max_batch_tokens,
            max_batch_requests=max_batch_requests,
            radix_threshold=radix_threshold,
            policy=policy,
            max_wait_s=max_wait_s,
            prefix=prefix_policy,
        )
        self._pipeline = Pipeline(
            runner,
            self._waiting,
            config,
            metrics=metrics,
            build_index=build_index or _default_build_index,
            resolve=lambda e, value: self._finish(e.payload, value, None),
            fail=lambda e, exc: self._finish(e.payload, None, exc),
            on_death=self._on_death,
            trace_len=trace_len,
        )

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._started:
                raise RuntimeError("Scheduler.start() called twice")
            self._started = self._accepting = True
        self._pipeline.start()

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop accepting; with ``drain`` finish queued work, else fail it with WorkerDead."""
        with self._lock:
            self._accepting = False
        dropped = self._waiting.close(clear=not drain)
        for e in dropped:
            self._finish(e.payload, None, WorkerDead("the scheduler is shutting down"))
        if self._started:
            self._pipeline.join(timeout)

    @property
    def alive(self) -> bool:
        return self._accepting and self._pipeline.alive

    @property
    def queue_size(self) -> int:
        return self._waiting.size

    @property
    def trace(self) -> tuple[BatchTrace, ...]:
        """The most recent batches (bounded), oldest first."""
        return tuple(self._pipeline.trace)

    @property
    def worker_idle_ratio(self) -> float:
        return self._pipeline.idle_ratio

    # -- settling (any thread) ------------------------------------------------------------------
    def _finish(self, ticket: _Ticket, value: Any, exc: BaseException | None) -> None:
        with self._lock:
            self._pending.discard(ticket)
        try:
            ticket.loop.call_soon_threadsafe(_settle, ticket.future, value, exc)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _on_death(self, exc: BaseException) -> None:
        with self._lock:
            self._accepting = False
            tickets = list(self._pending)
            self._pending.clear()
        self._waiting.close(clear=True)
        reason = WorkerDead(f"the model worker died: {type(exc).__name__}: {exc}")
        for t in tickets:
            self._finish(t, None, reason)

    def _cancel(self, tickets: list[_Ticket]) -> None:
        for t in tickets:
            t.cancelled = True
            if t.future.done():
                if not t.future.cancelled():
                    t.future.exception()  # mark retrieved: no "never retrieved" noise
            else:
                t.future.cancel()
        with self._lock:
            self._pending.difference_update(tickets)
        self._waiting.discard(lambda e: e.payload.cancelled)

    # -- the event-loop side --------------------------------------------------------------------
    async def submit(self, items: list[list[int]], *, is_disconnected=None, all_tokens: bool = False) -> SubmitResult:
        """Run ``items`` (token id lists, each 1..max_batch_tokens long) and return their outputs.

        ``all_tokens``: each output is the item's per-token states, np.ndarray [L, E] float32.
        """
        if not items:
            raise ValueError("submit needs at least one item")
        for i, ids in enumerate(items):
            if not 1 <= len(ids) <= self.max_batch_tokens:
                raise ValueError(f"item {i} has {len(ids)} tokens; allowed 1..{self.max_batch_tokens}")
        loop = asyncio.get_running_loop()
        rid = next(self._request_ids)
        now = time.monotonic()
        tickets = [_Ticket(loop) for _ in items]
        entries = [Entry(rid, list(ids), now, payload=t, all_tokens=all_tokens) for ids, t in zip(items, tickets)]
        with self._lock:
            if not self.alive:
                raise WorkerDead("the model worker is not alive")
            try:
                self._waiting.push(entries)
            except QueueClosed as exc:
                raise WorkerDead(str(exc)) from None
            self._pending.update(tickets)
        try:
            results = await self._await_all(tickets, is_disconnected)
        except BaseException:  # error, cancellation or disconnect: drop what is still queued
            self._cancel(tickets)
            raise
        return SubmitResult(
            outputs=[r[0] for r in results],
            queue_time_s=max(r[1] for r in results),
            inference_time_s=max(r[2] for r in results),
            compute_tokens=sum(len(ids) for ids in items),
        )

    async def _await_all(self, tickets: list[_Ticket], is_disconnected) -> list[tuple]:
        """Results in item order; raises the first failure without waiting for the rest."""
        remaining = {t.future for t in tickets}
        watch = asyncio.ensure_future(self._watch(is_disconnected)) if is_disconnected else None
        try:
            while remaining:
                waitset = remaining | {watch} if watch is not None else remaining
                done, _ = await asyncio.wait(waitset, return_when=asyncio.FIRST_COMPLETED)
                if watch is not None and watch in done:
                    watch.result()  # re-raises if is_disconnected itself failed
                    raise ClientDisconnected("the client disconnected")
                for f in done:
                    if f.exception() is not None:
                        raise f.exception()
                remaining -= done
        finally:
            if watch is not None:
                watch.cancel()
        return [t.future.result() for t in tickets]

    async def _watch(self, is_disconnected) -> None:
        """Returns once ``is_disconnected()`` (sync or async) reports True."""
        while True:
            await asyncio.sleep(self.disconnect_poll_s)
            gone = is_disconnected()
            if inspect.isawaitable(gone):
                gone = await gone
            if gone:
                return

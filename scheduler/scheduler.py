"""The Scheduler: the asyncio-facing front of the batching pipeline.

``submit`` runs on the event loop: it enqueues one entry per item (one request's items
contiguous) and awaits one future per request; the pipeline reports a batch's outcomes at once
(``_resolve``, any thread), posted to each loop with one ``loop.call_soon_threadsafe`` and
recorded there (``_settle``), so the loop's work per batch is one callback, not one per item.
Invariant: every request's future is resolved exactly once, by its outputs, the first error of
one of its items (BatchFailed, WorkerDead), or its own cancellation. The runner is any
``ModelRunner`` (scheduler/contract.py). With ``lane``, a lone short request at an idle CPU
pipeline is not queued: it claims the loop lane, and a callback on its loop runs its batch there
(``_run_claim``; scheduler/lane.py says when, and why batching is not lost).

Client disconnects: cancellation is the mechanism. When the task awaiting ``submit`` is
cancelled (the server does that when the client goes away), its entries still waiting are
dropped (the runner never sees them); entries already in a batch run, and their results are
discarded. If a pipeline thread dies, the scheduler stops admitting, fails everything pending
with WorkerDead and calls ``on_death(exc)`` once.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, cast

from . import stages
from .contract import ModelRunner
from .forming import Entry, PrefixPolicy
from .metrics import Metrics
from .outcomes import WorkerDead
from .pipeline import Pipeline
from .policy import make_former
from .waiting import QueueClosed, WaitQueue

log = logging.getLogger(__name__)


@dataclass
class SubmitResult:
    outputs: list  # one per item: float (a score), float32 [E] (pooled) or [L, E] (all_tokens)
    queue_time_s: float  # max over items of (forward start - enqueue)
    inference_time_s: float  # max over the batches the items were in
    compute_tokens: int  # tokens computed for the items (prefix-cache hits excluded)


class Ticket:
    """One request's bookkeeping, carried in each of its entries' ``payload`` as (ticket, item);
    ``future`` is the request's outcome (``Scheduler.enqueue``).

    Written only on the request's own loop (``_settle``), so it needs no lock."""

    __slots__ = ("future", "loop", "label", "outputs", "left", "queue_s", "inference_s", "compute")

    def __init__(self, loop: asyncio.AbstractEventLoop, label: str, n_items: int) -> None:
        self.loop, self.label = loop, label
        self.future: asyncio.Future = loop.create_future()
        self.outputs: list = [None] * n_items
        self.left = n_items
        self.queue_s = self.inference_s = 0.0
        self.compute = 0


def _ticket(entry: Entry) -> Ticket:
    return cast(Ticket, entry.payload[0])  # type: ignore[index]  # the scheduler alone makes entries


# One entry's outcome as the pipeline reports it: (entry, (output, queue s, forward s, tokens), error).
Outcome = tuple[Entry, Any, BaseException | None]


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
        inline: bool | None = None,
        lane: bool = False,
    ) -> None:
        """``inline``: a lone batch at an idle pipeline runs on the prep thread (no hand-over);
        None: on a CPU runner (a runner without ``device`` counts as one), where a forward is
        synchronous and the hand-over buys nothing; an accelerator keeps forwards on the worker.
        ``lane`` (with ``inline``): a lone short request at an idle pipeline runs on the loop that
        submits it, when such batches measure cheap and no other request is pending
        (scheduler/lane.py)."""
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        if max_batch_requests is not None and max_batch_requests < 1:
            raise ValueError("max_batch_requests must be >= 1 or None")
        self.runner = runner
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        self._on_death_cb = on_death
        self._lock = threading.Lock()  # guards _pending, _accepting, _died; taken before the queue's
        self._pending: set[Ticket] = set()
        self._accepting = self._started = self._died = False
        self._request_ids = itertools.count()
        if metrics is not None:
            metrics.batching_policy.labels(policy=policy).set(1)
        self._waiting = WaitQueue(on_size=metrics.queue_size.set if metrics is not None else None)
        former = make_former(policy, max_tokens=max_batch_tokens, max_requests=max_batch_requests, prefix=prefix_policy)
        self._lane = lane
        self._claim: list[Entry] | None = None  # one request's entries waiting to run in the loop lane
        self._pipeline = Pipeline(
            runner, self._waiting, former, metrics=metrics,
            resolve=self._resolve,
            label=lambda e: _ticket(e).label,
            on_death=self._on_death,
            warm_up=warm_up,
            inline=_on_cpu(runner) if inline is None else inline,
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
            claimed, self._claim = self._claim, None
            if claimed is not None:
                with contextlib.suppress(QueueClosed):  # queued like the rest: drained or dropped below
                    self._waiting.push(claimed)
        dropped = self._waiting.close(clear=not drain)
        self._resolve([(e, None, WorkerDead("the server is shutting down")) for e in dropped])
        if self._started:
            self._pipeline.join(timeout)

    @property
    def alive(self) -> bool:
        return self._accepting and self._pipeline.alive  # flags read without a lock: every request asks

    @property
    def queue_size(self) -> int:
        return self._waiting.size

    # -- settling requests (any thread -> each request's loop) --------------------------------
    def _resolve(self, outcomes: list[Outcome]) -> None:
        """Post a batch's outcomes to their loops: one ``call_soon_threadsafe`` per loop, not per item."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}
        for o in outcomes:
            by_loop.setdefault(_ticket(o[0]).loop, []).append(o)
        for loop, part in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._settle, part)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def _settle(self, outcomes: list[Outcome]) -> None:
        """On the loop: record each item's outcome; a request ends at its first error or last item."""
        for entry, value, exc in outcomes:
            t = _ticket(entry)
            if t.future.done():
                continue  # failed already, or cancelled by the client side
            if exc is not None:
                self._finish(t)
                t.future.set_exception(exc)
                continue
            output, queue_s, inference_s, cost = value
            t.outputs[entry.payload[1]] = output  # type: ignore[index]
            t.queue_s, t.inference_s = max(t.queue_s, queue_s), max(t.inference_s, inference_s)
            t.compute += cost
            t.left -= 1
            if t.left == 0:
                self._finish(t)
                t.future.set_result(SubmitResult(t.outputs, t.queue_s, t.inference_s, t.compute))
                if stages.recorder is not None:
                    stages.recorder("settled", (t.label,))

    def _finish(self, ticket: Ticket) -> None:
        with self._lock:
            self._pending.discard(ticket)

    def _on_death(self, exc: BaseException) -> None:
        with self._lock:
            if self._died:
                return
            self._died, self._accepting = True, False
            self._claim = None  # its ticket is pending: failed below
            tickets = list(self._pending)
            self._pending.clear()
        self._waiting.close(clear=True)  # its entries' tickets are among the pending ones
        by_loop: dict[asyncio.AbstractEventLoop, list[Ticket]] = {}
        for t in tickets:
            by_loop.setdefault(t.loop, []).append(t)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(_fail_all, group, "the model worker is not running")
            except RuntimeError:
                pass
        if self._on_death_cb is not None:
            try:
                self._on_death_cb(exc)
            except Exception:  # noqa: BLE001 - the callback must not mask the death
                log.exception("the scheduler's on_death callback failed")

    def cancel(self, ticket: Ticket) -> None:
        """Drop what is still queued of ``ticket``'s request and cancel its future (on its loop)."""
        if not ticket.future.done():
            ticket.future.cancel()
        self._finish(ticket)
        with self._lock:
            if self._claim is not None and _ticket(self._claim[0]) is ticket:
                self._claim = None
        self._waiting.discard(lambda e: e.payload[0] is ticket)  # type: ignore[index]

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
        ticket = self.enqueue(items, request_id=request_id, all_tokens=all_tokens, namespace=namespace)
        try:
            return await ticket.future
        except BaseException:  # failure or cancellation: drop what is still queued
            self.cancel(ticket)
            raise

    def enqueue(
        self, items: list[list[int]], *, request_id: str | None = None, all_tokens: bool = False,
        namespace: bytes = b"",
    ) -> Ticket:
        """``submit`` without the wait, on the running loop: the items are queued, and the ticket's
        ``future`` resolves as ``submit`` would return or raise; ``cancel(ticket)`` drops what is
        still queued. For a caller that answers from a callback rather than a task of its own
        (the engine of several front ends, server/frontends/engine.py)."""
        if not items:
            raise ValueError("submit needs at least one item")
        for i, ids in enumerate(items):
            if not 1 <= len(ids) <= self.max_batch_tokens:
                raise ValueError(f"item {i} has {len(ids)} tokens; allowed 1..{self.max_batch_tokens}")
        loop = asyncio.get_running_loop()
        rid = next(self._request_ids)
        ticket = Ticket(loop, request_id if request_id is not None else f"#{rid}", len(items))
        now = time.monotonic()
        # NOTE: the item lists are kept, not copied: the caller hands them over.
        entries = [Entry(rid, ids, now, payload=(ticket, i), all_tokens=all_tokens, namespace=namespace)
                   for i, ids in enumerate(items)]
        here = self._lane and self._pipeline.lane.admits(sum(map(len, items)))
        with self._lock:
            if not (self._accepting and self._pipeline.alive):
                raise WorkerDead("the model worker is not running")
            claimed, self._claim = self._claim, None
            if claimed is not None:  # another request came with the claimed one: both are queued
                self._push(claimed)
                here = False
            here = here and not self._pending  # alone: no other request is waiting for its answer
            if here:
                self._claim = entries
            else:
                self._push(entries)
            self._pending.add(ticket)
        if stages.recorder is not None:
            stages.recorder("admitted", (ticket.label,))
        if here:
            loop.call_soon(self._run_claim, entries)
        return ticket

    def _run_claim(self, entries: list[Entry]) -> None:
        """On the loop, after what was ready with the claim: run the claimed entries in the loop
        lane if they are still claimed and the pipeline idle, else queue them (scheduler/lane.py)."""
        with self._lock:
            if self._claim is not entries:
                return  # queued already (another submit came, the scheduler stopped) or cancelled
            self._claim = None
        if self._pipeline.run_here(entries, self._settle):
            return
        with self._lock:
            try:
                self._push(entries)
                return
            except WorkerDead as exc:
                error = exc
        self._settle([(e, None, error) for e in entries[:1]])

    def _push(self, entries: list[Entry]) -> None:
        try:
            self._waiting.push(entries)
        except QueueClosed:
            raise WorkerDead("the server is shutting down") from None


def _on_cpu(runner: ModelRunner) -> bool:
    device = getattr(runner, "device", None)
    return device is None or getattr(device, "type", str(device)) == "cpu"


def _fail_all(tickets: list[Ticket], message: str) -> None:
    """On the loop: end every still-open request of ``tickets`` with WorkerDead."""
    for t in tickets:
        if not t.future.done():
            t.future.set_exception(WorkerDead(message))

"""The two threads behind the scheduler: CPU batch preparation and the model worker.

The prep thread forms a batch from the waiting queue, packs it (input_ids [N], cu_seqlens [B+1]
int32), builds and gates the RadixIndex, calls ``runner.prepare`` and hands the result over a
queue of size 1. The worker runs ``runner.run`` and settles every entry of the batch.
Invariant: while the worker runs batch k, the prep thread is already preparing batch k+1; an
exception on one batch fails only that batch's entries, while a BaseException (or any death of
either thread) takes the whole pipeline down through ``on_death``.
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .forming import Entry, PrefixPolicy, form_batch, form_batch_fifo
from .metrics import Metrics
from .timing import JustInTime
from .radix import positions_from_cu_seqlens
from .waiting import WaitQueue

log = logging.getLogger(__name__)

_STOP = object()  # sentinel on the hand-off queue: no more batches


class BatchFailed(Exception):
    """The model raised on a batch holding some of the request's items (HTTP 500)."""


class WorkerDead(Exception):
    """The model worker is not alive, or the scheduler is shutting down (HTTP 503)."""


@dataclass(frozen=True)
class PipelineConfig:
    max_batch_tokens: int
    max_batch_requests: int | None
    radix_threshold: float
    policy: str = "fifo"
    max_wait_s: float = 0.0  # hold a batch open this long for more entries (0: form at once)
    prefix: PrefixPolicy | None = None  # knobs of policy "prefix" (None: its defaults)


@dataclass
class BatchTrace:
    """Timestamps (time.monotonic) and sizes of one batch; the worker fills the forward half."""

    batch_id: int
    request_ids: tuple[int, ...]
    n_items: int
    n_tokens: int
    prep_start: float
    n_compact: int = 0
    used_index: bool = False
    prep_end: float = float("nan")
    forward_start: float = float("nan")
    forward_end: float = float("nan")
    error: str | None = None


@dataclass
class _Prepared:
    entries: list[Entry]
    forward: Any  # whatever runner.prepare returned
    trace: BatchTrace


def pack(entries: Sequence[Entry]) -> tuple[np.ndarray, np.ndarray]:
    """input_ids int32 [N] and cu_seqlens int32 [B+1] of a batch."""
    lengths = np.fromiter((e.n_tokens for e in entries), dtype=np.int64, count=len(entries))
    cu_seqlens = np.zeros(len(entries) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    input_ids = np.array(list(itertools.chain.from_iterable(e.input_ids for e in entries)), dtype=np.int32)
    return input_ids, cu_seqlens


def use_index(threshold: float, ratio: float) -> bool:
    """DESIGN.md gate: 0 never (not even built), >= 1 always, else iff ratio < threshold."""
    return threshold >= 1.0 or (threshold > 0.0 and ratio < threshold)


class Pipeline:
    """Owns the prep and worker threads, the hand-off queue and the batch trace ring buffer."""

    def __init__(
        self,
        runner,
        waiting: WaitQueue,
        config: PipelineConfig,
        *,
        metrics: Metrics | None,
        build_index: Callable[[np.ndarray, np.ndarray, np.ndarray], Any],
        resolve: Callable[[Entry, tuple], None],
        fail: Callable[[Entry, BaseException], None],
        on_death: Callable[[BaseException], None],
        trace_len: int = 256,
    ) -> None:
        self.runner = runner
        self.waiting = waiting
        self.config = config
        self.metrics = metrics
        self._build_index = build_index
        self._resolve, self._fail, self._on_death = resolve, fail, on_death
        self.trace: collections.deque[BatchTrace] = collections.deque(maxlen=trace_len)
        self._handoff: queue.Queue = queue.Queue(maxsize=1)
        # One credit: the prep thread forms batch N+1 only once the worker has taken batch N.
        # NOTE: without it, prep would form N+2 while N runs and block in put(), locking entries
        # into a batch chosen from a shallow queue (worse prefix grouping, later cancellation).
        self._slot = threading.Semaphore(1)
        self._dead = threading.Event()
        self._batch_ids = 0
        self._idle_s = 0.0
        self._worker_t0 = 0.0
        self._prep_busy = False  # entries taken off the queue but not yet handed over
        # Under "prefix", form the next batch just before the running one ends (scheduler/timing.py).
        self.clock = JustInTime() if config.policy == "prefix" else None
        if config.policy == "prefix":
            # NOTE: form_batch imports it lazily; import it here, not under the queue's lock.
            from . import prefix_forming  # noqa: F401
        self._prep = threading.Thread(target=self._guard, args=(self._prep_loop,), name="rs-prep", daemon=True)
        self._worker = threading.Thread(target=self._guard, args=(self._worker_loop,), name="rs-worker", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._worker_t0 = time.monotonic()
        self._prep.start()
        self._worker.start()

    @property
    def alive(self) -> bool:
        return self._worker.is_alive() and not self._dead.is_set()

    @property
    def dead(self) -> bool:
        return self._dead.is_set()

    def join(self, timeout: float) -> bool:
        """Wait for both threads to exit (the queue must be closed first); True if they did."""
        deadline = time.monotonic() + timeout
        for t in (self._prep, self._worker):
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
        return not (self._prep.is_alive() or self._worker.is_alive())

    @property
    def idle_ratio(self) -> float:
        wall = time.monotonic() - self._worker_t0
        return self._idle_s / wall if wall > 0 else 0.0

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - any escape means the pipeline is gone
            log.exception("scheduler thread %s died", threading.current_thread().name)
            self._dead.set()
            self._on_death(exc)

    # -- prep thread ----------------------------------------------------------------------------
    def _select(self, waiting: Sequence[Entry], now: float) -> list[int]:
        c = self.config
        chosen = form_batch(
            waiting, max_tokens=c.max_batch_tokens, max_requests=c.max_batch_requests, policy=c.policy, now=now,
            prefix=c.prefix,
        )
        if self.clock is not None:
            # Forming late only pays while grouping does: when the former chose FIFO's batch, the
            # clock forms at once except on its periodic probes (scheduler/timing.py).
            fifo = form_batch_fifo(waiting, max_tokens=c.max_batch_tokens, max_requests=c.max_batch_requests)
            self.clock.grouping = chosen != fifo
        return chosen

    def _hold(self, waiting: Sequence[Entry], now: float) -> float:
        c = self.config
        if c.max_wait_s <= 0:
            return 0.0
        full_tokens = sum(e.n_tokens for e in waiting) >= c.max_batch_tokens
        full_requests = c.max_batch_requests is not None and len(waiting) >= c.max_batch_requests
        if full_tokens or full_requests:
            return 0.0
        return max(0.0, waiting[0].arrival + c.max_wait_s - now)

    def _prep_loop(self) -> None:
        while not self._dead.is_set():
            if not self._slot.acquire(timeout=0.05):
                continue
            self._wait_until_due()
            entries = self.waiting.take(self._select, hold=self._hold)
            if not entries:
                break  # closed and drained
            self._prep_busy = True
            prepared = self._prepare(entries)
            if prepared is None:
                self._slot.release()  # nothing handed over: the slot is still free
            handed = prepared is None or self._hand_over(prepared)
            self._prep_busy = False
            if not handed:
                for e in entries:
                    self._fail(e, WorkerDead("the model worker is not alive"))
                return
        self._hand_over(_STOP)

    def _wait_until_due(self) -> None:
        """Hold off forming while the running forward is far from its expected end."""
        if self.clock is None or not self.clock.hold_this_time():
            return
        while not self._dead.is_set():
            delay = self.clock.delay_s()
            if delay <= 0:
                return
            self._dead.wait(min(delay, 0.05))

    def _prepare(self, entries: list[Entry]) -> _Prepared | None:
        t0 = time.monotonic()
        self._batch_ids += 1
        trace = BatchTrace(
            batch_id=self._batch_ids,
            request_ids=tuple(dict.fromkeys(e.request_id for e in entries)),
            n_items=len(entries),
            n_tokens=sum(e.n_tokens for e in entries),
            prep_start=t0,
        )
        try:
            input_ids, cu_seqlens = pack(entries)
            n = int(cu_seqlens[-1])
            index, ratio = None, 1.0
            if self.config.radix_threshold > 0.0:
                built = self._build_index(input_ids, positions_from_cu_seqlens(cu_seqlens), cu_seqlens)
                ratio = float(built.ratio)
                if use_index(self.config.radix_threshold, ratio):
                    index = built
            trace.used_index = index is not None
            trace.n_compact = int(len(index.compact_ids)) if index is not None else n
            mask = np.fromiter((e.all_tokens for e in entries), dtype=bool, count=len(entries))  # [B]
            extra = {"all_tokens": mask} if mask.any() else {}  # NOTE: runners without it keep working
            forward = self.runner.prepare(input_ids, cu_seqlens, index=index, **extra)
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            log.exception("batch %d failed during preparation", trace.batch_id)
            trace.error = f"{type(exc).__name__}: {exc}"
            trace.prep_end = time.monotonic()
            self.trace.append(trace)
            for e in entries:
                self._fail(e, BatchFailed(f"batch preparation failed: {trace.error}"))
            return None
        trace.prep_end = time.monotonic()
        self.trace.append(trace)
        if self.clock is not None:
            self.clock.prepared(trace.prep_end - t0)
        m = self.metrics
        if m is not None:
            m.batch_next_size.observe(len(entries))
            m.batch_next_tokens.observe(n)
            m.compression_ratio.observe(ratio)
            m.tokens_total.labels(kind="original").inc(n)
            m.tokens_total.labels(kind="compact").inc(trace.n_compact)
            m.batch_prep_duration.observe(trace.prep_end - t0)
        return _Prepared(entries, forward, trace)

    def _hand_over(self, item: object) -> bool:
        """Blocking put that gives up (False) once the worker is dead."""
        while True:
            try:
                self._handoff.put(item, timeout=0.05)
                return True
            except queue.Full:
                if self._dead.is_set():
                    return False

    # -- worker thread --------------------------------------------------------------------------
    def _worker_loop(self) -> None:
        while True:
            wait_start = time.monotonic()
            try:
                item = self._handoff.get(timeout=0.05)
            except queue.Empty:
                if self._dead.is_set():
                    return
                # Waiting while work exists counts as idle (the prep thread is the bottleneck).
                if self.waiting.size or self._prep_busy:
                    self._idle_s += time.monotonic() - wait_start
                continue
            if item is _STOP:
                return
            self._slot.release()  # the prep thread may form the next batch while this one runs
            got = time.monotonic()
            # Idle: the part of this wait during which this batch's entries already existed.
            oldest = min(e.arrival for e in item.entries)
            self._idle_s += max(0.0, got - max(wait_start, oldest))
            self._run(item)
            if self.metrics is not None:
                self.metrics.worker_idle_ratio.set(self.idle_ratio)

    def _forward_ended(self, trace: BatchTrace) -> None:
        if self.clock is not None:
            self.clock.forward_ended(trace.forward_end - trace.forward_start)

    def _run(self, batch: _Prepared) -> None:
        trace = batch.trace
        trace.forward_start = time.monotonic()
        if self.clock is not None:
            self.clock.forward_started(trace.forward_start, trace.n_compact)
        try:
            out = self.runner.run(batch.forward)
            # A list: one output per item (batches with all_tokens items); else [B] or [B, E].
            arr = out if isinstance(out, list) else np.asarray(
                out.detach().cpu() if hasattr(out, "detach") else out, dtype=np.float32)
            if len(arr) != len(batch.entries):
                raise RuntimeError(f"runner returned {len(arr)} rows for {len(batch.entries)} items")
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            trace.forward_end = time.monotonic()
            self._forward_ended(trace)
            trace.error = f"{type(exc).__name__}: {exc}"
            log.exception("batch %d failed in the model", trace.batch_id)
            for e in batch.entries:
                self._fail(e, BatchFailed(f"the model failed on this batch: {trace.error}"))
            return
        trace.forward_end = time.monotonic()
        self._forward_ended(trace)
        forward_s = trace.forward_end - trace.forward_start
        if self.metrics is not None:
            self.metrics.forward_duration.observe(forward_s)
        for i, e in enumerate(batch.entries):
            # [B] raw scores (rerankers) -> Python float; [B, E] pooled states -> own [E] copy.
            value = arr[i] if isinstance(arr, list) else float(arr[i]) if arr.ndim == 1 else arr[i].copy()
            self._resolve(e, (value, trace.forward_start - e.arrival, forward_s))

"""The two threads behind the scheduler, and the life of one batch as short steps in one place.

    prep thread:    form -> prepare (pack; runner.prepare builds and gates the index, then tensors)
    worker thread:  execute (runner.run)
    settle thread:  [wait for a PendingOutput] -> deliver (one output to each entry)

With ``inline`` (a CPU runner), a batch formed while the worker holds none and nobody else waits
runs on the prep thread itself, and is delivered there: a lone request pays no hand-over.
``run_here`` (the loop lane, scheduler/lane.py) runs a lone short batch on the calling thread
instead, only while the pipeline is idle and under the lock (``_exclusive``) the prep thread
holds from forming a batch to running or handing it over, so forwards never overlap. Every
batch the worker runs is delivered by the settling thread (scheduler/settling.py), which first
waits for it when ``run`` returned a ``PendingOutput`` (an accelerator's copy to the host still
under way): the worker only launches forwards, at most IN_FLIGHT of them unsettled, and splitting
outputs and resolving entries never delay the next launch.

The prep thread forms a batch from a snapshot of the waiting queue (no lock held while the former
runs), packs it (input_ids [N], cu_seqlens [B+1] int32) and calls ``runner.prepare``, which builds
and gates the trie itself; it hands the result over a queue of size 1. The worker executes the
batch (``runner.run``); its outputs are delivered in launch order: every entry is resolved with its
own output, or with an error. The runner is any ``ModelRunner`` (scheduler/contract.py), read
through nothing else. Invariants: while the worker runs batch k, the prep thread is already
preparing batch k+1 (never k+2: one slot); an ``Exception`` in any step fails only that batch's
entries (scheduler/outcomes.py); a ``BaseException``, a bug outside the per-batch guards or a
device fault kills a thread, and then ``on_death`` takes the whole pipeline down. Before its
first batch the worker runs the optional ``warm_up`` (per-thread handles are made on the serving
thread). State shared between the threads goes through the hand-off queue, a lock, or an Event.
"""
from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from typing import Any, Callable

from . import stages
from .contract import ModelRunner
from .faults import DeviceFault
from .forming import Entry, Former
from .lane import Lane
from .metrics import Metrics
from .outcomes import Batch, Outcomes, Resolve, WorkerDead
from .packing import marks, pack
from .settling import Ready, Settler
from .waiting import WaitQueue

log = logging.getLogger(__name__)

_STOP = object()  # sentinel on the hand-off queue: no more batches
_POLL_S = 0.05  # how often blocked threads look at the dead flag
IN_FLIGHT = 2  # batches launched and not yet settled: the one computing and the one queued behind it
SETTLE_ON_DEATH_S = 10.0  # at most this long for launched batches to be delivered when a thread dies


def _pending(out: Any) -> bool:
    """Is ``out`` a ``PendingOutput``? Its one method, looked up directly (a Protocol check is slow)."""
    return callable(getattr(out, "result", None))


class Pipeline:
    """Owns the prep and worker threads and the hand-off queue between them."""

    def __init__(
        self,
        runner: ModelRunner,
        waiting: WaitQueue,
        former: Former,
        *,
        metrics: Metrics | None,
        resolve: Resolve,
        label: Callable[[Entry], str],
        on_death: Callable[[BaseException], None],
        warm_up: Callable[[], Any] | None = None,
        inline: bool = False,
    ) -> None:
        self.runner, self.waiting, self.former, self.metrics = runner, waiting, former, metrics
        self._warm_up = warm_up  # run first on the worker thread (per-thread handles, allocator growth)
        self.warmed = threading.Event()  # set once the worker's warm-up ended, however it ended
        self.inline = inline
        self._label, self._on_death = label, on_death
        self._outcomes = Outcomes(resolve, metrics)  # each batch's entries answered: outputs or errors
        self._handoff: queue.Queue[Any] = queue.Queue(maxsize=1)  # a Batch or _STOP
        # One credit: the prep thread forms batch N+1 only once the worker has started batch N.
        # NOTE: without it, prep would form N+2 while N runs and block in put(), locking entries
        # into a batch chosen from a shallow queue (worse prefix grouping, later cancellation).
        self._slot = threading.Semaphore(1)
        self._dead = threading.Event()
        self._started, self._exited = False, threading.Event()  # _exited: a thread returned or died
        self._prep_busy = threading.Event()  # entries taken off the queue, not yet handed over
        self._batch_ids = itertools.count(1)
        self._idle_lock = threading.Lock()
        self._idle_s = 0.0
        # Held by whichever thread holds a batch outside the worker: the prep thread from forming
        # it to handing it over (or running it), the loop lane while it runs one (``run_here``).
        self._exclusive = threading.Lock()
        self.lane = Lane()
        self._t0 = 0.0
        self._prep = threading.Thread(target=self._supervise, args=(self._prep_loop,), name="rs-prep", daemon=True)
        self._worker = threading.Thread(target=self._supervise, args=(self._worker_loop,), name="rs-worker",
                                        daemon=True)
        self._handed_lock = threading.Lock()
        self._handed = 0  # batches handed to the worker and not yet finished by it
        # Pending outputs (an accelerator) settle on their own thread, so the worker only launches.
        self._in_flight = threading.Semaphore(IN_FLIGHT)
        self._settler = Settler(finish=self._finish, fail=self._copy_failed, supervise=self._supervise,
                                dead=self._dead, poll_s=_POLL_S)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._t0 = time.monotonic()
        self._prep.start()
        self._worker.start()
        self._settler.start()
        self._started = True

    @property
    def alive(self) -> bool:
        """Started, no thread returned, no device fault: flags, no thread's lock (every request asks)."""
        return self._started and not self._exited.is_set() and not self._dead.is_set()

    def join(self, timeout: float) -> bool:
        """Wait for the threads to exit (the queue must be closed first); True if they did."""
        deadline = time.monotonic() + timeout
        threads = [t for t in (self._prep, self._worker, self._settler.thread) if t is not None]
        for t in threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    @property
    def idle_ratio(self) -> float:
        wall = time.monotonic() - self._t0
        with self._idle_lock:
            return self._idle_s / wall if wall > 0 else 0.0

    def _supervise(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - any escape means the pipeline is gone
            log.critical("scheduler thread %s died", threading.current_thread().name, exc_info=exc)
            self._dead.set()
            self._settle_launched()
            self._on_death(exc)
        finally:
            self._exited.set()

    def _settle_launched(self) -> None:
        """Batches that ran before a death still reach their clients: the settling thread delivers
        what it holds (it exits once its queue is empty) before every pending request fails."""
        t = self._settler.thread
        if t is not None and t is not threading.current_thread():
            t.join(SETTLE_ON_DEATH_S)

    # -- prep thread: form -> prepare -> hand over ----------------------------------------------
    def _prep_loop(self) -> None:
        while not self._dead.is_set():
            if not self._slot.acquire(timeout=_POLL_S):
                continue
            formed = self._form()
            if formed is None:
                break  # closed and drained
            with self._exclusive:
                ran = self._prepare_and_pass(*formed)
            if ran is not None:  # delivered once the lock is free: the answer may bring the next request
                self._finish(*ran)
        self._put(_STOP)

    def _prepare_and_pass(self, batch: Batch, error: Exception | None) -> tuple[Batch, Any] | None:
        """Prepare a formed batch, then run it here (a lone one: returns it with its output, on
        the host, for ``_finish``) or hand it to the worker."""
        self._prep_busy.set()
        if error is not None:
            self._outcomes.fail(batch, "form", error)
        prepared = error is None and self._prepare(batch)
        if prepared and self._lone():
            self._prep_busy.clear()
            return self._execute(batch, here=True)  # frees the slot as it starts
        handed = prepared and self._hand_over(batch)
        self._prep_busy.clear()
        if not handed:
            self._slot.release()  # else the worker frees it when it starts this batch
        return None

    def run_here(self, entries: list[Entry], resolve: Resolve) -> bool:
        """The loop lane (scheduler/lane.py): prepare, run and deliver ``entries`` on this thread,
        reporting their outcomes to ``resolve`` (here, directly), if the pipeline is idle: nothing
        waits, the prep thread holds no batch and the worker none. False: nothing was done (queue
        them). A failure fails these entries only; a device fault takes the pipeline down."""
        if not self.inline or not self._exclusive.acquire(blocking=False):
            return False
        try:
            if self._dead.is_set() or self.waiting.size or self._handed:  # one int read: no lock needed
                return False
            batch = self._open(entries)
            try:
                if self._prepare(batch):
                    self._run_here(batch, resolve)
            except DeviceFault as exc:  # its entries are answered (WorkerDead); the device is unusable
                self._dead.set()
                self._on_death(exc)
            return True
        finally:
            self._exclusive.release()

    def _run_here(self, batch: Batch, resolve: Resolve) -> None:
        batch.forward_start = time.monotonic()
        try:
            out = self.runner.run(batch.prepared)
            out = out.result() if _pending(out) else out
            if stages.recorder is not None:
                stages.recorder("forward", batch.labels)
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            self._outcomes.fail(batch, "run", exc)
            return
        finally:
            batch.forward_end = time.monotonic()
        self._observe_lone(batch)
        if self.metrics is not None:
            self.metrics.loop_lane_batches.inc()
        try:
            self._outcomes.deliver(batch, out, resolve)
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            self._outcomes.fail(batch, "deliver", exc)

    def _observe_lone(self, batch: Batch) -> None:
        """A lone batch ran: its ``prepare`` and ``run`` wall time is what the loop lane would cost."""
        if batch.prepared is not None:
            self.lane.observe(batch.prepared.n_tokens, time.monotonic() - batch.prep_start)

    def _lone(self) -> bool:
        """Run this batch here rather than hand it over? Only with ``inline``, when the worker
        holds no batch and nothing else waits: then the hand-over would buy no overlap, only a
        thread wake-up (a lone request at an idle CPU pipeline)."""
        if not self.inline or self.waiting.size:
            return False
        with self._handed_lock:
            return self._handed == 0

    def _form(self) -> tuple[Batch, Exception | None] | None:
        """The next batch, taken off the queue; None once the queue is closed and drained.

        If the former raises, the batch is the oldest request alone and carries the error.
        """
        while not self._dead.is_set():
            waiting = self.waiting.snapshot(timeout=_POLL_S)
            if waiting is None:
                continue  # nothing yet
            if not waiting:
                return None
            error: Exception | None = None
            try:
                chosen = [waiting[i] for i in self.former(waiting, time.monotonic())]
                if not chosen:
                    raise RuntimeError("the batch former chose nothing from a non-empty queue")
            except Exception as exc:  # noqa: BLE001 - fails this batch only
                head = waiting[0].request_id
                chosen, error = list(itertools.takewhile(lambda e: e.request_id == head, waiting)), exc
            entries = self.waiting.remove(chosen)  # drops entries cancelled since the snapshot
            if entries:
                return self._open(entries), error
        return None

    def _open(self, entries: list[Entry]) -> Batch:
        labels = tuple(dict.fromkeys(self._label(e) for e in entries))
        if stages.recorder is not None:
            stages.recorder("formed", labels)
        return Batch(next(self._batch_ids), entries, time.monotonic(), labels)

    def _prepare(self, batch: Batch) -> bool:
        """Pack the batch and ``runner.prepare`` it; False: it failed (its entries are answered)."""
        try:
            input_ids, cu_seqlens = pack(batch.entries)
            mask, spaces = marks(batch.entries)
            batch.prepared = p = self.runner.prepare(input_ids, cu_seqlens, all_tokens=mask, namespaces=spaces)
            if self.metrics is not None:
                self.metrics.batch_prepared(len(batch.entries), p, time.monotonic() - batch.prep_start)
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            self._outcomes.fail(batch, "prepare", exc)
            return False
        if stages.recorder is not None:
            stages.recorder("prepared", batch.labels)
        return True

    def _hand_over(self, batch: Batch) -> bool:
        try:
            self._count_handed(+1)
            if self._put(batch):
                return True
            self._count_handed(-1)
            self._outcomes.fail_all(batch, WorkerDead, "the model worker is not running")
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            self._outcomes.fail(batch, "hand over", exc)
        return False

    def _put(self, item: object) -> bool:
        """Blocking put that gives up (False) once the pipeline is dead."""
        while not self._dead.is_set():
            try:
                self._handoff.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    # -- worker thread: execute -> deliver ------------------------------------------------------
    def _worker_loop(self) -> None:
        try:
            if self._warm_up is not None:
                self._warm_up()  # an exception here kills the worker: the pipeline never serves
        except BaseException:
            self._dead.set()  # before `warmed`: whoever waits on it reads the pipeline dead
            raise
        finally:
            self.warmed.set()
        while (batch := self._take()) is not _STOP:
            try:
                self._execute(batch)
            finally:
                self._count_handed(-1)
        self._settler.stop()

    def _count_handed(self, delta: int) -> None:
        with self._handed_lock:
            self._handed += delta

    def _take(self) -> Any:
        """The next handed-over batch (or _STOP); waiting while work exists counts as idle."""
        while True:
            wait_start = time.monotonic()
            try:
                batch = self._handoff.get(timeout=_POLL_S)
            except queue.Empty:
                if self._dead.is_set():
                    return _STOP
                if self.waiting.size or self._prep_busy.is_set():
                    self._add_idle(time.monotonic() - wait_start)
                continue
            if batch is not _STOP:
                # Idle: the part of this wait during which this batch's entries already existed.
                oldest = min(e.arrival for e in batch.entries)
                self._add_idle(max(0.0, time.monotonic() - max(wait_start, oldest)))
            return batch

    def _add_idle(self, seconds: float) -> None:
        with self._idle_lock:
            self._idle_s += seconds
        if self.metrics is not None:
            self.metrics.worker_idle_ratio.set(self.idle_ratio)

    def _execute(self, batch: Batch, *, here: bool = False) -> tuple[Batch, Any] | None:
        """runner.run on the prepared batch; a failure fails this batch.

        Its output goes to the settling thread, which waits for it if it is a ``PendingOutput``
        (the copy to the host still under way) and delivers it; at most IN_FLIGHT batches are
        launched and not yet settled. ``here`` (a lone batch on the prep thread): the batch and
        its output on the host are returned, for the caller to deliver (``_finish``)."""
        while not self._in_flight.acquire(timeout=_POLL_S):
            if self._dead.is_set():
                self._outcomes.fail_all(batch, WorkerDead, "the model worker is not running")
                return None
        batch.forward_start = time.monotonic()
        self._slot.release()  # the prep thread may form the next batch while this one runs
        try:
            out = self.runner.run(batch.prepared)
            if stages.recorder is not None:
                stages.recorder("forward", batch.labels)
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            batch.forward_end = time.monotonic()
            self._in_flight.release()
            self._outcomes.fail(batch, "run", exc)
            return None
        if _pending(out):
            self._settler.submit(batch, out)
        elif here:
            self._observe_lone(batch)  # before the delivery: the next request may follow at once
            return batch, out
        else:
            batch.forward_end = time.monotonic()  # on the host already: the forward ended now
            self._settler.submit(batch, Ready(out))
        return None

    def _finish(self, batch: Batch, out: Any) -> None:
        """The forward's output is on the host: deliver it, free its in-flight place."""
        if math.isnan(batch.forward_end):
            batch.forward_end = time.monotonic()
        self._in_flight.release()
        try:
            self._outcomes.deliver(batch, out)
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            self._outcomes.fail(batch, "deliver", exc)

    def _copy_failed(self, batch: Batch, exc: Exception) -> None:
        batch.forward_end = time.monotonic()
        self._in_flight.release()
        self._outcomes.fail(batch, "copy to host", exc)

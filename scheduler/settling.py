"""The settling thread: every batch the worker ran is delivered here, not on the worker.

On an accelerator ``runner.run`` may return a ``PendingOutput`` (scheduler/contract.py): the
forward and the copy of its outputs are queued on the device, and ``result()`` blocks until they
are done; an output already on the host comes wrapped in ``Ready``. The pipeline hands each batch
to ``Settler.submit``; the settling thread waits for the outputs in launch order and calls
``finish(batch, outputs)`` (split and resolve every entry), or ``fail(batch, exc)`` when the wait
raised, so the worker's share of a batch ends with the launch. The thread starts with the
pipeline (``start``), never per batch: a process whose address space is full when a batch ends
cannot start a thread, and a start that failed then would kill the worker.
Invariant: batches settle in the order they were launched, each exactly once.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from .contract import PendingOutput

_STOP = object()


class Ready:
    """An output already on the host, in ``PendingOutput``'s shape."""

    __slots__ = ("out",)

    def __init__(self, out: Any) -> None:
        self.out = out

    def result(self) -> Any:
        return self.out


class Settler:
    def __init__(self, *, finish: Callable[[Any, Any], None], fail: Callable[[Any, Exception], None],
                 supervise: Callable[[Callable[[], None]], None], dead: threading.Event, poll_s: float) -> None:
        self._finish, self._fail, self._supervise, self._dead, self._poll_s = finish, fail, supervise, dead, poll_s
        self._queue: queue.Queue[Any] = queue.Queue()  # (batch, PendingOutput) or _STOP
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the settling thread (once, with the pipeline's other threads)."""
        if self.thread is None:
            t = threading.Thread(target=self._supervise, args=(self._loop,), name="rs-settle", daemon=True)
            t.start()
            # NOTE: published only once started: `Pipeline.alive` reads a thread that is
            # not yet running as dead, and would turn requests away with 503 meanwhile.
            self.thread = t

    def submit(self, batch: Any, pending: PendingOutput) -> None:
        self._queue.put((batch, pending))

    def stop(self) -> None:
        """No more batches: the thread exits once it has settled those before."""
        if self.thread is not None:
            self._queue.put(_STOP)

    def _loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._poll_s)
            except queue.Empty:
                if self._dead.is_set():
                    return
                continue
            if item is _STOP:
                return
            batch, pending = item
            try:
                out = pending.result()
            except Exception as exc:  # noqa: BLE001 - fails this batch only
                self._fail(batch, exc)
                continue
            self._finish(batch, out)

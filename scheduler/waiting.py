"""The waiting queue shared by the event loop (producer) and the prep thread (consumer).

Invariant: entries are kept in arrival order and the entries of one request are pushed in one
call, so they stay contiguous (what ``form_batch`` relies on). A cancelled entry is never handed
out: ``discard`` removes it eagerly and ``take`` drops any that slipped through.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from .forming import Entry

# select(waiting, now) -> ascending indices into ``waiting`` of the next batch.
Select = Callable[[Sequence[Entry], float], list[int]]
# hold(waiting, now) -> seconds to keep waiting for more entries before forming (0: form now).
Hold = Callable[[Sequence[Entry], float], float]


class QueueClosed(RuntimeError):
    """Raised by ``push`` once the queue no longer accepts entries."""


class WaitQueue:
    """A condition-guarded list of entries; ``take`` blocks until a batch can be formed."""

    def __init__(
        self,
        *,
        is_live: Callable[[Entry], bool] = lambda e: True,
        on_size: Callable[[int], None] | None = None,
    ) -> None:
        self._cond = threading.Condition()
        self._entries: list[Entry] = []
        self._closed = False
        self._is_live = is_live
        self._on_size = on_size

    @property
    def size(self) -> int:
        return len(self._entries)

    @property
    def closed(self) -> bool:
        return self._closed

    def _sized(self) -> None:  # caller holds the lock
        if self._on_size is not None:
            self._on_size(len(self._entries))

    def push(self, entries: Sequence[Entry]) -> None:
        """Append one request's entries (contiguous); wakes the consumer."""
        with self._cond:
            if self._closed:
                raise QueueClosed("the scheduler no longer accepts work")
            self._entries.extend(entries)
            self._sized()
            self._cond.notify_all()

    def discard(self, drop: Callable[[Entry], bool]) -> int:
        """Remove every waiting entry for which ``drop`` is true; returns how many."""
        with self._cond:
            kept = [e for e in self._entries if not drop(e)]
            removed = len(self._entries) - len(kept)
            if removed:
                self._entries = kept
                self._sized()
            return removed

    def close(self, *, clear: bool = False) -> list[Entry]:
        """Stop accepting; with ``clear`` also empty the queue and return what was waiting."""
        with self._cond:
            self._closed = True
            cleared: list[Entry] = []
            if clear:
                cleared, self._entries = self._entries, []
                self._sized()
            self._cond.notify_all()
            return cleared

    def take(self, select: Select, *, hold: Hold | None = None) -> list[Entry]:
        """Block until entries wait, then remove and return the batch ``select`` picks.

        Returns [] only once the queue is closed and empty (the consumer's signal to exit).
        While open, ``hold`` may delay forming so that more entries can join the batch.
        """
        with self._cond:
            while True:
                self._entries = [e for e in self._entries if self._is_live(e)]
                if not self._entries:
                    self._sized()
                    if self._closed:
                        return []
                    self._cond.wait()
                    continue
                now = time.monotonic()
                delay = 0.0 if (hold is None or self._closed) else hold(self._entries, now)
                if delay > 0:
                    self._cond.wait(timeout=delay)
                    continue
                chosen = select(self._entries, now)
                if not chosen:  # a policy must always make progress on a non-empty queue
                    raise RuntimeError("batch former selected nothing from a non-empty queue")
                picked = set(chosen)
                batch = [self._entries[i] for i in chosen]
                self._entries = [e for i, e in enumerate(self._entries) if i not in picked]
                self._sized()
                return batch

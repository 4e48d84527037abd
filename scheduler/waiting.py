"""The waiting queue shared by the event loop (producer) and the prep thread (consumer).

Invariant: entries are kept in arrival order and the entries of one request are pushed in one
call, so they stay contiguous (what the formers rely on). The lock is held only for list
operations, never while a batch is formed: the prep thread takes a ``snapshot``, forms a batch
from it without the lock, then ``remove``s the chosen entries, and any that were cancelled in
between are gone by then and simply not returned.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

from .forming import Entry


class QueueClosed(RuntimeError):
    """Raised by ``push`` once the queue no longer accepts entries."""


class WaitQueue:
    """A condition-guarded list of entries."""

    def __init__(self, *, on_size: Callable[[int], None] | None = None) -> None:
        self._cond = threading.Condition()
        self._entries: list[Entry] = []
        self._closed = False
        self._on_size = on_size

    @property
    def size(self) -> int:
        return len(self._entries)

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

    def snapshot(self, timeout: float | None = None) -> list[Entry] | None:
        """A copy of what waits, once something does; [] once closed and empty; None on timeout."""
        with self._cond:
            if not self._entries and not self._closed:
                self._cond.wait(timeout)
            if self._entries:
                return list(self._entries)
            return [] if self._closed else None

    def remove(self, chosen: Sequence[Entry]) -> list[Entry]:
        """Take ``chosen`` out of the queue; returns those still there (in ``chosen``'s order)."""
        picked = set(chosen)
        with self._cond:
            present = {e for e in self._entries if e in picked}
            if present:
                self._entries = [e for e in self._entries if e not in present]
                self._sized()
        return [e for e in chosen if e in present]

"""When the prep thread should form the next batch while the worker runs one.

Batch N+1 cannot start before batch N's forward ends, so forming it the moment N starts gains
nothing and sees the shallowest queue: the clients whose results N-1 just returned have not sent
their next requests yet. The prefix-aware former can only group what is waiting, so under that
policy the prep thread forms N+1 late: once 75% of N's expected forward has passed, minus the
expected preparation time and a margin. The forward estimate is an exponential moving average of
seconds per computed row (N' with the trie, N without) times the running batch's rows, since
grouped batches vary in N'; preparation is an EMA of recent batches. A wrong estimate costs worker
idle time (too late) or nothing beyond forming at once (too early). While the former keeps
choosing FIFO's batch the clock holds off only every few formations, to probe.
Invariant: the worker writes (forward_started/ended) and the prep thread reads, all under one lock.
"""
from __future__ import annotations

import threading
import time


class JustInTime:
    """EMA estimates of forward and preparation time; ``delay_s`` says how long to hold off."""

    def __init__(self, *, margin_s: float = 0.005, slack: float = 0.25, alpha: float = 0.3,
                 probe_every: int = 4) -> None:
        # slack: share of the expected forward left as headroom, so a forward that ends early
        # (estimates are noisy) rarely finds the next batch unprepared.
        self.margin_s, self.slack, self.alpha, self.probe_every = margin_s, slack, alpha, probe_every
        self._lock = threading.Lock()
        self._row_s: float | None = None  # EMA of forward seconds per computed row
        self._prep_s = 0.0  # EMA of preparation durations
        self._running_since: float | None = None  # monotonic start of the forward in flight
        self._running_rows = 1
        self._grouping = True  # did the last formation regroup?
        self._formations = 0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def forward_started(self, t: float, rows: int) -> None:
        with self._lock:
            self._running_since, self._running_rows = t, max(1, rows)

    def forward_ended(self, duration_s: float) -> None:
        with self._lock:
            self._row_s = self._ema(self._row_s, duration_s / self._running_rows)
            self._running_since = None

    def prepared(self, duration_s: float) -> None:
        with self._lock:
            self._prep_s = self._ema(self._prep_s, duration_s)

    def set_grouping(self, regrouped: bool) -> None:
        with self._lock:
            self._grouping = regrouped

    def hold_this_time(self) -> bool:
        """Called once per formation: hold off (see delay_s) this time, or form at once?

        While the former keeps choosing FIFO's batch, hold off only every probe_every-th time, to
        find out whether a deeper queue would regroup (it cannot tell from a shallow one).
        """
        with self._lock:
            self._formations += 1
            return self._grouping or self._formations % self.probe_every == 0

    def delay_s(self, now: float | None = None) -> float:
        """Seconds to wait before forming the next batch (0: form now)."""
        with self._lock:
            since, row_s, rows, prep_s = self._running_since, self._row_s, self._running_rows, self._prep_s
        if since is None or row_s is None:
            return 0.0  # nothing running, or no estimate yet: form at once
        now = time.monotonic() if now is None else now
        due = since + (1.0 - self.slack) * row_s * rows - prep_s - self.margin_s
        return max(0.0, due - now)

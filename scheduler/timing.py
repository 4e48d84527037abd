"""When the prep thread should form the next batch while the worker runs one.

Batch N+1 cannot start before batch N's forward ends, so forming it the moment N starts gains
nothing and sees the shallowest queue: the clients whose results N-1 just returned have not sent
their next requests yet. The prefix-aware former (scheduler/prefix_forming.py) can only group
what is waiting, so under that policy the prep thread forms N+1 just in time: at N's expected
end minus the expected preparation time and a margin. Estimates are exponential moving averages
of recent batches; a wrong estimate costs at most the margin of worker idle time (too late) or
nothing beyond today's behaviour (too early).
"""
from __future__ import annotations

import time


class JustInTime:
    """EMA estimates of forward and preparation time; ``delay_s`` says how long to hold off."""

    def __init__(self, *, margin_s: float = 0.005, alpha: float = 0.3) -> None:
        self.margin_s, self.alpha = margin_s, alpha
        self.forward_s: float | None = None  # EMA of forward durations
        self.prep_s = 0.0  # EMA of preparation durations
        self._running_since: float | None = None  # monotonic start of the forward in flight

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def forward_started(self, t: float) -> None:
        self._running_since = t

    def forward_ended(self, duration_s: float) -> None:
        self._running_since = None
        self.forward_s = self._ema(self.forward_s, duration_s)

    def prepared(self, duration_s: float) -> None:
        self.prep_s = self._ema(self.prep_s, duration_s)

    def delay_s(self, now: float | None = None) -> float:
        """Seconds to wait before forming the next batch (0: form now)."""
        since, forward = self._running_since, self.forward_s
        if since is None or forward is None:
            return 0.0  # nothing running, or no estimate yet: form at once
        now = time.monotonic() if now is None else now
        return max(0.0, since + forward - self.prep_s - self.margin_s - now)

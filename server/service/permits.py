"""Per-item admission: ``Permits`` hands out one permit per input item and never waits.

When too few are left the request is refused at once (429), so nothing queues behind an
overloaded server. Permits taken for a request are given back on every path out.
"""
from __future__ import annotations


class Permits:
    """Non-blocking counting permits (event-loop confined: no lock needed)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.in_use = 0

    def try_acquire(self, n: int) -> bool:
        if self.in_use + n > self.total:
            return False
        self.in_use += n
        return True

    def release(self, n: int) -> None:
        self.in_use -= n
        assert self.in_use >= 0, "released more permits than acquired"

"""What a person watching a batch job sees: one redrawn progress line on a terminal, log lines otherwise.

Each report names the lines done (of the total, when the input is a file), the rate in lines/s
and model tokens/s, the ETA, N'/N (rows the model ran on / tokens in the batches, so far) and the
failed lines. On a terminal the line is redrawn in place at most every ``TTY_INTERVAL_S``; in a
log (stderr is a file or a pipe) a plain line is written at most every ``LOG_INTERVAL_S``, and
always at the end.

The ETA is the lines left over the rate measured from the first batch's answers on, not from the
start: the first answer waits for a whole batch to be formed, tokenized and run (seconds on a
CPU), and a rate that counted that wait would put the ETA at hours for a job of seconds; the
lines answered within ``BURST_S`` of the first one (its batch, answered together) are not counted
either, or they would read as lines done in no time. Until later answers there is no ETA
(``ETA -``).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import IO

TTY_INTERVAL_S = 0.2
BURST_S = 0.25  # answers this close to the first one came with it (one batch)
LOG_INTERVAL_S = 10.0


@dataclass
class Snapshot:
    done: int  # lines answered this run
    failed: int
    tokens: float  # tokens the model ran this run (N)
    ratio: float  # N'/N so far


def fmt_duration(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """Reports a job's progress to ``stream`` (default stderr)."""

    def __init__(self, total: int | None, *, stream: IO[str] | None = None, tty: bool | None = None,
                 clock=time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total = total  # lines this run has to answer (None: unknown, e.g. stdin)
        self.clock = clock
        self.start = clock()
        self.last = float("-inf")
        self.width = 0
        self.first: tuple[float, int] | None = None  # (clock at the first answer, lines done with its batch)

    def begin(self) -> None:
        """Start the clock (the job's first line; model loading is not counted)."""
        self.start = self.clock()
        self.last = float("-inf")
        self.first = None

    def eta(self, done: int) -> float | None:
        """Seconds left at the rate since the first answer; None before there is one."""
        if self.total is None or self.first is None:
            return None
        t0, done0 = self.first
        span = self.clock() - t0
        if done <= done0 or span <= 0:
            return None
        return max(0, self.total - done) / ((done - done0) / span)

    def line(self, s: Snapshot) -> str:
        elapsed = max(1e-9, self.clock() - self.start)
        rate = s.done / elapsed
        of = f"/{self.total}" if self.total is not None else ""
        pct = f" {100.0 * s.done / self.total:5.1f}%" if self.total else ""
        eta = ""
        if self.total is not None:
            left = self.eta(s.done)
            eta = f" | ETA {fmt_duration(left) if left is not None else '-'}"
        return (f"batch: {s.done}{of} lines{pct} | {rate:.1f} lines/s | {s.tokens / elapsed:.0f} tokens/s"
                f"{eta} | N'/N {s.ratio:.3f} | failed {s.failed} | {fmt_duration(elapsed)}")

    def update(self, s: Snapshot, *, final: bool = False) -> None:
        now = self.clock()
        if self.first is None and s.done > 0:
            self.first = (now, s.done)
        elif self.first is not None and now - self.first[0] <= BURST_S:
            self.first = (self.first[0], s.done)  # the rest of the first batch
        interval = TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S
        if not final and now - self.last < interval:
            return
        self.last = now
        text = self.line(s)
        if self.tty:
            pad = " " * max(0, self.width - len(text))
            self.width = len(text)
            self.stream.write("\r" + text + pad + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A message on its own line (on a terminal, the progress line is redrawn after it)."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

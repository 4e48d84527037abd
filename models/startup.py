"""Launch to healthy, stage by stage: what each part of start-up took (the log and /info's ``startup``).

Stages, in the order they run: import (process start to the model code loaded), config (checkpoint
resolved, config, tokenizer, attention paths), weights (model built without initialisation, the
checkpoint read into it), kernel choices (CPU linear and attention kernels), cache allocation (the
prefix cache), app (routes, sockets), freeze (start-up objects out of the collector's reach),
warm-up (the serving path once, on the worker thread). ``total`` is process start to the end of
the warm-up, when the server turns healthy: the stages sum to at most it (what runs between them,
e.g. uvicorn's start, is in the total only).
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("models.runner")

STAGES = ("import", "config", "weights", "kernel choices", "cache allocation", "app", "freeze", "warm-up")


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc; an exec keeps the start), or None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after "pid (comm)"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Stage -> seconds, each stage timed from the previous mark (``mark``) or explicitly (``add``).

    ``seconds`` is the live dict /info answers: stages appear as they finish."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._began = time.perf_counter()
        self._last = self._began

    def since_process_start(self) -> None:
        """Count from the process's start, not this object's: the interpreter and imports before."""
        age = process_age()
        if age is not None:
            self._began = self._last = time.perf_counter() - age

    def mark(self, stage: str) -> float:
        """End `stage` now: the seconds since the previous mark (or the clock's start)."""
        now = time.perf_counter()
        took = self.seconds[stage] = round(now - self._last, 4)
        self._last = now
        return took

    def add(self, stage: str, seconds: float) -> None:
        """A stage timed elsewhere (the warm-up, on the worker thread)."""
        self.seconds[stage] = round(seconds, 4)
        self._last = time.perf_counter()

    def finish(self) -> dict[str, float]:
        """Record ``total`` (start to now) and log one line per stage; returns the stages."""
        self.seconds["total"] = round(time.perf_counter() - self._began, 4)
        for stage in (*STAGES, "total"):
            if stage in self.seconds:
                log.info("start-up %s: %.2f s", stage, self.seconds[stage])
        return self.seconds


_PROCESS: StartupClock | None = None


def begin_process() -> StartupClock:
    """The serving process's clock, counted from the process's start (the command line calls this
    once, before loading); `load_runner` then marks its stages on it."""
    global _PROCESS
    _PROCESS = StartupClock()
    _PROCESS.since_process_start()
    return _PROCESS


def clock_for_load() -> StartupClock:
    """The process's clock when the command line began one and no runner took it yet; else a
    fresh one (a runner loaded in a test or a benchmark times its own stages)."""
    global _PROCESS
    clock, _PROCESS = _PROCESS, None
    return clock if clock is not None else StartupClock()

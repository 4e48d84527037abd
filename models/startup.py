"""Launch to healthy, stage by stage: what each part of start-up took (the log and /info's ``startup``).

Stages, in the order they run: import (program start to the model code loaded), config (checkpoint
resolved, config, tokenizer, attention paths), weights (model built without initialisation, the
checkpoint read into it), kernel choices (CPU linear and attention kernels), cache allocation (the
prefix cache), app (routes, sockets), freeze (start-up objects out of the collector's reach),
warm-up (the serving path once, on the worker thread). ``total`` is process start to the end of
the warm-up, when the server turns healthy: the stages sum to at most it (what runs between them,
e.g. uvicorn's start, is in the total only).

The program's start is the process's (Linux /proc), unless the process ran another program first
and then exec'd radixserve: a shell whose last command is radixserve does so (``sh -c 'pip install
... && radixserve ...'``), and its earlier commands are not radixserve's start-up. Linux keeps no
exec time, so such a start is recognised by what the shell left behind, children it waited for
(their CPU time and page faults, counted in /proc/self/stat's c* fields, which a Python
interpreter that has started no child leaves at zero), and is then taken as the CPU time the
process had used when radixserve's command line began: a lower bound on the time since the exec
(the shell's own CPU time before it is a few milliseconds).
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
        fields = _stat()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after "pid (comm)"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _stat() -> list[str]:
    """/proc/self/stat's fields from field 3 on (after "pid (comm)", which may hold spaces)."""
    with open("/proc/self/stat") as f:
        return f.read().rpartition(")")[2].split()


def exec_after_waiting() -> bool:
    """Whether this process reaped children before this call: a shell that ran earlier commands and
    then exec'd this program (cminflt, cmajflt, cutime, cstime: stat(5) fields 11, 13, 16, 17)."""
    try:
        fields = _stat()
        return any(int(fields[i]) for i in (8, 10, 13, 14))
    except (OSError, ValueError, IndexError):
        return False


_ENTRY: tuple[float, float | None] | None = None


def note_entry() -> None:
    """Called first thing by the command line (before it starts any child): the program's age then.
    See the module docstring for a process that was a shell first."""
    global _ENTRY
    now = time.perf_counter()
    age = process_age()
    if age is not None and exec_after_waiting():
        age = min(age, time.process_time())
    _ENTRY = (now, age)


class StartupClock:
    """Stage -> seconds, each stage timed from the previous mark (``mark``) or explicitly (``add``).

    ``seconds`` is the live dict /info answers: stages appear as they finish."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._began = time.perf_counter()
        self._last = self._began

    def since_process_start(self) -> None:
        """Count from the program's start, not this object's: the interpreter and imports before
        (the command line's ``note_entry`` says when the program started; else the process's start)."""
        if _ENTRY is not None and _ENTRY[1] is not None:
            self._began = self._last = _ENTRY[0] - _ENTRY[1]
            return
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

"""Opt-in stage stamps: when each request passed each step of its path (benchmarks only).

A request's path, in the order its stamps are taken::

    received   the front door has the request (server/http/front_door.py), before the body is read
    tokenized  its token ids are built (server/service/core.py)
    admitted   its entries are in the waiting queue (scheduler/scheduler.py, ``submit``)
    formed     the prep thread took them into a batch (scheduler/pipeline.py)
    prepared   ``runner.prepare`` returned for that batch
    forward    ``runner.run`` returned (the outputs are on the host or on their way)
    settled    the loop recorded the request's outcome (its future is resolved)
    written    the answer's last body message is handed to the transport (the send follows)

Each site reads ``stages.recorder`` once and calls it only when it is set, so with no recorder
(the server's default; nothing in the product sets one) a stamp costs one attribute check. A
recorder is ``recorder(stage, labels)``: ``labels`` are the request ids the stamp applies to
(a batch's stamps apply to every request in it); it takes the time itself, on whatever thread
calls it, and must be cheap and thread-safe. ``benchmarks/bench_latency.py`` installs one in a
server child and turns the stamps into per-stage durations (``durations``).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

STAGES = ("received", "tokenized", "admitted", "formed", "prepared", "forward", "settled", "written")

Recorder = Callable[[str, Iterable[str]], None]
recorder: Recorder | None = None  # set by a benchmark; None in the product


class StampLog:
    """A recorder that keeps ``{request id: {stage: time.perf_counter()}}``; the first stamp of a
    stage wins (a request split over two batches keeps its first batch's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stamps: dict[str, dict[str, float]] = {}

    def __call__(self, stage: str, labels: Iterable[str]) -> None:
        now = time.perf_counter()
        with self._lock:
            for label in labels:
                self.stamps.setdefault(label, {}).setdefault(stage, now)

    def take(self) -> dict[str, dict[str, float]]:
        """Everything stamped so far, and a fresh log."""
        with self._lock:
            out, self.stamps = self.stamps, {}
        return out


def durations(stamps: dict[str, float], sent: float, done: float) -> dict[str, float] | None:
    """Seconds per step of one request from the client's send (``sent``) to its last byte read
    (``done``), both ``time.perf_counter()`` on the same machine (one monotonic clock for every
    process): ``loop`` (sent -> received), then one step per stage ending at it, then ``client``
    (written -> done). The steps sum to ``done - sent``; None when a stage is missing."""
    if any(s not in stamps for s in STAGES):
        return None
    names = ("loop", "tokenization", "admit", "batch formed", "prep", "forward", "settle", "response written")
    out, last = {}, sent
    for name, stage in zip(names, STAGES):
        out[name] = stamps[stage] - last
        last = stamps[stage]
    out["client read"] = done - last
    return out

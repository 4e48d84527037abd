"""A batch in flight, and how its entries are answered: each with its output, or all with an error.

The pipeline's threads (and the loop lane) hand a batch's entries their ends at once through
``Outcomes``: ``deliver`` gives each entry its own output with its queue time, the forward time
and the tokens it cost; ``fail`` answers every entry with a generic error (``BatchFailed``, HTTP
500) and writes the cause to the log, except that a device fault (``faults.classify``: a
poisoned CUDA context) answers ``WorkerDead`` (503) and raises ``DeviceFault``, which takes the
pipeline down, and out of memory also frees the allocator's cached blocks and is counted.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from .contract import Prepared
from .faults import DeviceFault, classify, release_cached_memory
from .forming import Entry
from .metrics import Metrics
from .packing import split_outputs

# NOTE: the pipeline's logger: a batch's failure is a line of its life, wherever it is answered.
log = logging.getLogger("scheduler.pipeline")

# A batch's entries' ends at once: [(entry, (output, queue s, forward s, tokens) or None, error or None)]
Resolve = Callable[[list[tuple[Entry, Any, BaseException | None]]], None]


class BatchFailed(Exception):
    """A batch holding some of the request's items failed (HTTP 500); the log has the cause."""


class WorkerDead(Exception):
    """The model worker is not alive, or the scheduler is shutting down (HTTP 503)."""


@dataclass
class Batch:
    """One batch in flight; owned by one thread at a time (the hand-off queue passes it on)."""

    batch_id: int
    entries: list[Entry]
    prep_start: float
    labels: tuple[str, ...]  # the batch's request ids, for the log
    prepared: Prepared | None = None  # what runner.prepare returned
    forward_start: float = float("nan")
    forward_end: float = float("nan")


class Outcomes:
    """Answers batches' entries through ``resolve`` (or the one a call names)."""

    def __init__(self, resolve: Resolve, metrics: Metrics | None) -> None:
        self.resolve, self.metrics = resolve, metrics

    def deliver(self, batch: Batch, out: Any, resolve: Resolve | None = None) -> None:
        """Resolve every entry with its output, its queue time, the forward time and its cost."""
        values = split_outputs(out, len(batch.entries))
        # Tokens each item cost: its length less what the runner read from its prefix cache.
        computed = list(batch.prepared.computed_tokens) if batch.prepared is not None else []
        if len(computed) != len(values):
            raise RuntimeError(f"the runner counted computed tokens for {len(computed)} of {len(values)} items")
        forward_s = batch.forward_end - batch.forward_start
        if self.metrics is not None:
            self.metrics.forward_duration.observe(forward_s)
        start = batch.forward_start
        (resolve or self.resolve)([(e, (value, start - e.arrival, forward_s, int(cost)), None)
                                   for e, value, cost in zip(batch.entries, values, computed)])

    def fail(self, batch: Batch, stage: str, exc: Exception) -> None:
        """Fail this batch only (details to the log, a generic error to the clients); out of memory
        also frees the allocator's cache, a device fault answers 503 and raises DeviceFault."""
        fault = classify(exc)
        if fault == "fatal":
            log.critical("batch %d hit a device fault at %s: %s: %s; requests %s; the device is unusable, "
                         "the pipeline stops", batch.batch_id, stage, type(exc).__name__, exc,
                         ", ".join(batch.labels), exc_info=exc)
            self.fail_all(batch, WorkerDead, "the model worker is not running")
            raise DeviceFault(f"device fault at {stage}: {type(exc).__name__}: {exc}") from exc
        log.error("batch %d failed at %s: %s: %s; requests %s", batch.batch_id, stage, type(exc).__name__, exc,
                  ", ".join(batch.labels), exc_info=exc)
        if fault == "oom":
            release_cached_memory()
            if self.metrics is not None:
                self.metrics.oom_batches.inc()
        self.fail_all(batch, BatchFailed, "the model failed on this batch")

    def fail_all(self, batch: Batch, error: type[Exception], message: str) -> None:
        # NOTE: one exception object per entry: each may be raised in its own task.
        self.resolve([(e, None, error(message)) for e in batch.entries])

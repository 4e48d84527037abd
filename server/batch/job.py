"""The batch job: read a window of lines, run it in grouped order, write its answers in input order.

Per window of ``window`` lines: lines already answered by an earlier run with the same output
file are skipped (by custom_id, counting repeats); lines that are not requests, or that repeat a
custom_id, become error lines; the requests are dispatched to the engine in grouped order
(server/batch/grouping.py) with at most ``in_flight`` lines at once, so the scheduler sees a
window's lines sorted by prefix; then the window's answer lines are written in input order as
one chunk (server/batch/output.py). Memory is bounded by the window: its lines, keys and answers.

Invariant: every request line gets exactly one answer line, whatever happens to it: an exception
while answering one line becomes that line's 500 error line, never a stopped job.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any, Iterable, Protocol

from server.batch import grouping
from server.batch.inprocess import Answer, Counters
from server.batch.lines import Invalid, Line, Request, answer_line, invalid_line, parse_line, read_lines
from server.batch.output import ChunkWriter, Resume
from server.batch.progress import Progress, Snapshot

log = logging.getLogger("radixserve.batch")


class LineEngine(Protocol):
    """What the job needs of an engine (server/batch/inprocess.py's ``Engine``; tests may fake it)."""

    async def call(self, request: Request) -> Answer: ...

    def encode_batch(self, texts: list[str]) -> list[Any]: ...

    def counters(self) -> Counters: ...


@dataclass(frozen=True)
class Options:
    window: int = 4096  # lines sorted and written together
    grouping: bool = True  # False: each window runs in input order (--no-grouping)
    in_flight: int = 256  # lines dispatched at once (a few batches: the scheduler always has the next one queued)
    max_line_bytes: int = 2_000_000  # bytes per input line (the server's payload limit)
    numbered: bool = True  # False: the input is one block of a larger one (error lines carry no line number)


@dataclass
class Totals:
    """What one run did."""

    lines: int = 0  # answer lines written this run
    failed: int = 0  # of them, error lines
    skipped: int = 0  # input lines an earlier run had answered
    computed: int = 0  # tokens the model computed (x-compute-tokens summed; prefix-cache hits excluded)
    shared_key_tokens: int = 0  # grouping keys' tokens shared with the line run before (see grouping)
    seconds: float = 0.0  # wall time of the run, from its first line read to its last chunk written
    cpu_seconds: float = 0.0  # CPU time of the whole process (all threads) over the same span
    start: Counters = field(default_factory=lambda: Counters(0.0, 0.0, 0.0))
    end: Counters = field(default_factory=lambda: Counters(0.0, 0.0, 0.0))

    @property
    def original(self) -> float:
        return self.end.original - self.start.original

    @property
    def compact(self) -> float:
        return self.end.compact - self.start.compact

    @property
    def cache_hit(self) -> float:
        return self.end.cache_hit - self.start.cache_hit

    def ratio(self) -> float:
        return self.compact / self.original if self.original else 1.0


class Job:
    """One run of a batch file through an engine into a writer."""

    def __init__(self, engine: LineEngine, writer: ChunkWriter, *, options: Options = Options(),
                 resume: Resume | None = None, progress: Progress | None = None) -> None:
        self.engine = engine
        self.writer = writer
        self.options = options
        self.resume = resume if resume is not None else Resume()
        self.progress = progress
        self.totals = Totals()
        self.seen: Counter = Counter()  # custom_id -> occurrences read so far this run

    async def run(self, source: IO[bytes]) -> Totals:
        return await self.run_lines(read_lines(source, max_bytes=self.options.max_line_bytes))

    async def run_lines(self, lines: Iterable[tuple[int, bytes | None]]) -> Totals:
        """The job on lines already read: (1-based line number, stripped bytes, None when over the
        limit), as ``read_lines`` yields them (server/batch/ray_data.py sends an actor a block so)."""
        t = self.totals
        t.start = t.end = self.engine.counters()
        t0, c0 = time.perf_counter(), time.process_time()
        if self.progress is not None:
            self.progress.begin()
        window: list[Line] = []
        for number, raw in lines:
            line = self._admit(parse_line(number, raw, max_bytes=self.options.max_line_bytes))
            if line is None:
                continue
            window.append(line)
            if len(window) >= self.options.window:
                await self._window(window)
                window = []
        if window:
            await self._window(window)
        t.end = self.engine.counters()
        t.seconds, t.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        self._report(final=True)
        return t

    def _admit(self, line: Line) -> Line | None:
        """None when an earlier run answered this line; a repeated custom_id becomes an error line."""
        cid = line.custom_id
        if cid is None:
            if line.line in self.resume.lines:
                self.totals.skipped += 1
                return None
            return line
        self.seen[cid] += 1
        if self.seen[cid] <= self.resume.ids[cid]:
            self.totals.skipped += 1
            return None
        if self.seen[cid] > 1 and isinstance(line, Request):
            return Invalid(line.line, cid, f"custom_id {cid!r} repeats an earlier line's; custom_ids must be unique")
        return line

    async def _window(self, window: list[Line]) -> None:
        requests = [(i, x) for i, x in enumerate(window) if isinstance(x, Request)]
        numbered = self.options.numbered
        answers: list[bytes | None] = [invalid_line(x, numbered=numbered) if isinstance(x, Invalid) else None
                                       for x in window]
        reqs = [r for _, r in requests]
        if self.options.grouping and len(reqs) > 1:
            ks = await asyncio.to_thread(grouping.keys, reqs, self.engine.encode_batch)
            order = sorted(range(len(reqs)), key=lambda j: (reqs[j].url, ks[j]))
            self.totals.shared_key_tokens += grouping.shared_prefix_tokens(order, ks)
        else:
            order = list(range(len(reqs)))
        gate = asyncio.Semaphore(self.options.in_flight)

        async def one(j: int) -> None:
            slot, request = requests[j]
            try:
                answer = await self.engine.call(request)
            except Exception:  # noqa: BLE001 - one line's fault is that line's error line
                log.exception("line %d (custom_id %r) failed", request.line, request.custom_id)
                answer = Answer(500, "-", b'{"error":"internal error in the batch job","error_type":"Backend"}', 0)
            finally:
                gate.release()
            answers[slot] = answer_line(request, answer.status, answer.request_id, answer.body)
            self.totals.computed += answer.compute_tokens
            if answer.status != 200:
                self.totals.failed += 1
            self.totals.lines += 1
            self._report()

        tasks = []
        for j in order:  # dispatched in grouped order: the scheduler queues them in this order
            await gate.acquire()
            tasks.append(asyncio.ensure_future(one(j)))
        await asyncio.gather(*tasks)
        for x in window:
            if isinstance(x, Invalid):
                self.totals.lines += 1
                self.totals.failed += 1
        done = [a for a in answers if a is not None]
        assert len(done) == len(window), "every line of a window is answered"
        await asyncio.to_thread(self.writer.write_chunk, done)
        self._report()

    def _report(self, *, final: bool = False) -> None:
        if self.progress is None:
            return
        t = self.totals
        now = self.engine.counters()
        original = now.original - t.start.original
        ratio = (now.compact - t.start.compact) / original if original else 1.0
        self.progress.update(Snapshot(done=t.lines, failed=t.failed, tokens=original, ratio=ratio), final=final)

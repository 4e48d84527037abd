"""The batch job on a Ray cluster: N Ray actors, one engine each, blocks dealt out round-robin.

  radixserve-batch -i requests.jsonl -o results.jsonl --model DIR --ray-actors 4
  # or from Python:
  from server.batch.ray_data import run_ray
  run_ray("requests.jsonl", "results.jsonl", model="Qwen/Qwen3-Reranker-0.6B", actors=4)

The driver reads the input and cuts it into blocks of at most ``window`` lines and, for a local
file, at most lines / ``actors`` (rounded up), so that a file smaller than actors x window is
still ``actors`` blocks. Block i goes to actor i mod ``actors``: the assignment is the driver's,
fixed before any block runs, so every actor answers its share whatever the machine's load (a
Ray Data actor pool hands each block to whichever actor is free and ready at that moment, and on
a busy machine one actor that loaded its model first took every block of a small file). Each
actor holds one engine (server/batch/inprocess.py: the model, its scheduler and the server's
app, built once) and runs the single-process job on its blocks in the order they were sent
(server/batch/job.py: the same prefix grouping, the same per-line errors, the line numbers of
the whole file). The driver waits for the blocks in input order and writes each as one chunk
(server/batch/output.py), so the output file is the one the single-process command writes for
the same input, line for line. At most ``QUEUED_PER_ACTOR`` blocks per actor are out at once
(one running, one queued behind it), which bounds the driver's memory.

A path that is not a local file (an object-store or cluster path) is read with Ray Data's
``read_text`` on the driver's side instead, in blocks of ``window`` lines; there blank lines are
dropped by the reader, so an error line for a line without a custom_id has ``error.line`` null.

What differs from the single-process command: a repeated custom_id is found only within a block;
and there is no resume: the output file is written anew.

``ray`` is imported only when a job runs: the rest of radixserve never needs it.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import io
import math
import os
import threading
from typing import Any, Iterator

from server.batch.job import Job, Options
from server.batch.lines import read_lines
from server.batch.output import ChunkWriter, Unrunnable
from server.batch.progress import Progress, Snapshot

WAIT_FOR_ACTORS_S = 3600  # actors loading their models (a hub download included); a bound against a hang only
QUEUED_PER_ACTOR = 2  # blocks sent to one actor and not yet written: one running, the next queued behind it

Block = list[tuple[int, bytes | None]]  # (1-based line number, stripped line; None: over the size limit)


@dataclasses.dataclass(frozen=True)
class Answered:
    """One block's answer, as an actor returns it to the driver."""

    data: bytes  # the answer lines, in the block's order
    lines: int
    failed: int
    original: float  # tokens in the batches (N) this block made
    compact: float  # rows the model ran on (N') for it


class BlockWorker:
    """One Ray actor: one engine for the actor's life, the batch job on each block it is sent."""

    def __init__(self, model: str, flags: dict[str, Any], options: Options) -> None:
        from server.batch.inprocess import Engine
        from server.config import ServerConfig

        self.options = options
        self.failed: str | None = None  # why the engine did not start (the driver reports it in one line)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="radixserve-batch-loop", daemon=True).start()
        try:
            self.engine = Engine.build(ServerConfig(model_id=model, **flags))
            asyncio.run_coroutine_threadsafe(self.engine.__aenter__(), self.loop).result()
        except Exception as exc:  # noqa: BLE001 - any start-up failure is one line and exit 2, as the server's
            self.failed = f"{type(exc).__name__}: {exc}"

    def ready(self) -> tuple[int, str | None]:
        """(this actor's process, why its engine did not start or None): answered once the model is loaded."""
        return os.getpid(), self.failed

    def answer(self, block: Block, numbered: bool) -> Answered:
        sink = io.BytesIO()
        job = Job(self.engine, ChunkWriter(sink, sync=False),
                  options=dataclasses.replace(self.options, window=max(1, len(block)), numbered=numbered))
        t = asyncio.run_coroutine_threadsafe(job.run_lines(block), self.loop).result()
        return Answered(sink.getvalue(), t.lines, t.failed, t.original, t.compact)


def blocks(path: str, *, window: int, actors: int) -> tuple[int, int | None]:
    """(lines per block, number of blocks): at most ``window`` lines per block, and at most a local
    file's lines / ``actors``; the number is None for a path that is not a local file (not counted)."""
    if not os.path.isfile(path):
        return window, None
    from server.batch.lines import count_lines

    n = count_lines(path)
    size = max(1, min(window, math.ceil(n / actors)))
    return size, max(1, math.ceil(n / size))


def local_blocks(path: str, size: int, max_bytes: int) -> Iterator[Block]:
    """The non-blank lines of a local file, ``size`` at a time, read as the single-process job reads them."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise Unrunnable(f"{path}: cannot read the input: {exc.strerror}") from None
    with f:
        block: Block = []
        for item in read_lines(f, max_bytes=max_bytes, name=path):
            block.append(item)
            if len(block) >= size:
                yield block
                block = []
        if block:
            yield block


def dataset_blocks(path: str, size: int, max_bytes: int) -> Iterator[Block]:
    """The lines of a path Ray Data reads (not a local file), ``size`` at a time, numbered in order."""
    import ray.data

    number = 0
    for batch in ray.data.read_text(path).iter_batches(batch_size=size, batch_format="numpy"):
        block: Block = []
        for text in batch["text"]:
            number += 1
            raw = str(text).encode("utf-8").strip()
            block.append((number, raw if len(raw) <= max_bytes else None))
        yield block


def run_ray(input_path: str, output_path: str, *, model: str, flags: dict[str, Any] | None = None,
            actors: int = 2, options: Options = Options(), cpus_per_actor: float | None = None,
            gpus_per_actor: float = 0.0, progress: Progress | None = None) -> dict[str, Any]:
    """Answer ``input_path`` into ``output_path`` on the Ray cluster ``ray.init`` connects to
    (a local one when none runs); ``flags``: ServerConfig fields (e.g. ``{"device": "cpu"}``).

    ``cpus_per_actor`` None: min(1, (the cluster's CPUs - 1) / actors), at least 0.1, so the
    actors leave one whole CPU to the driver and to Ray Data's read tasks (a path that is not a
    local file). ``progress``: reports per block written, from the first round of blocks on (the
    first block of each actor, answered together, is the first window of the ETA).

    Returns ``{"lines", "failed", "block": lines per block, "blocks": blocks in all,
    "actors": {"actor K (pid P)": {"lines": answered, "blocks": answered}}}``, in actor order.
    """
    import ray

    if not ray.is_initialized():
        ray.init()
    if cpus_per_actor is None:
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        cpus_per_actor = min(1.0, max(0.1, (cpus - 1.0) / actors))
    size, count = blocks(input_path, window=options.window, actors=actors)
    worker: Any = ray.remote(BlockWorker).options(num_cpus=cpus_per_actor, num_gpus=gpus_per_actor, max_concurrency=1)
    pool: list[Any] = [worker.remote(model, dict(flags or {}), options) for _ in range(actors)]
    try:
        started = ray.get([w.ready.remote() for w in pool], timeout=WAIT_FOR_ACTORS_S)  # every model loaded
    except ray.exceptions.RayError as exc:  # an actor that died or could not be placed
        started = [(0, next((x for x in str(exc).splitlines() if x.strip()), type(exc).__name__))]
    failed_to_start = [why for _, why in started if why is not None]
    if failed_to_start:
        for w in pool:
            ray.kill(w)
        raise Unrunnable(f"could not start: {failed_to_start[0]}")
    names = [f"actor {k} (pid {pid})" for k, (pid, _) in enumerate(started)]
    split = {name: {"lines": 0, "blocks": 0} for name in names}
    numbered = count is not None
    source = local_blocks(input_path, size, options.max_line_bytes) if numbered \
        else dataset_blocks(input_path, size, options.max_line_bytes)
    lines = failed = written = 0
    original = compact = 0.0
    out: collections.deque = collections.deque()  # (actor index, answer ref), in input order
    writer = ChunkWriter(open(output_path, "wb"), sync=True, name=output_path)
    if progress is not None:
        progress.begin()

    def write_oldest() -> None:
        nonlocal lines, failed, written, original, compact
        k, ref = out.popleft()
        try:
            got: Answered = ray.get(ref)
        except ray.exceptions.RayError as exc:  # the actor died (out of memory, its node lost): the job stops
            why = next((x for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
            raise Unrunnable(f"{names[k]} failed on block {written + 1} ({written} blocks written): {why}") from None
        writer.write_chunk([got.data])
        lines, failed, original, compact = lines + got.lines, failed + got.failed, original + got.original, \
            compact + got.compact
        split[names[k]]["lines"] += got.lines
        split[names[k]]["blocks"] += 1
        written += 1
        if progress is not None and written >= actors and out:  # from the first round on; the last: below
            progress.update(Snapshot(done=lines, failed=failed, tokens=original,
                                     ratio=compact / original if original else 1.0))

    try:
        for i, block in enumerate(source):
            k = i % actors  # round-robin: block i to actor i mod N, whatever the timing
            out.append((k, pool[k].answer.remote(block, numbered)))
            if len(out) >= QUEUED_PER_ACTOR * actors:
                write_oldest()
        while out:
            write_oldest()
    finally:
        writer.close()
        for w in pool:
            ray.kill(w)
    if progress is not None:
        progress.update(Snapshot(done=lines, failed=failed, tokens=original,
                                 ratio=compact / original if original else 1.0), final=True)
    return {"lines": lines, "failed": failed, "block": size, "blocks": written, "actors": split}

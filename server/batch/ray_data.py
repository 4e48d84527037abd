"""The batch job on a Ray cluster: a Ray Data pipeline with one engine per actor.

  radixserve-batch -i requests.jsonl -o results.jsonl --model DIR --ray-actors 4
  # or from Python:
  from server.batch.ray_data import run_ray
  run_ray("requests.jsonl", "results.jsonl", model="Qwen/Qwen3-Reranker-0.6B", actors=4)

The input is read as text lines (``ray.data.read_text``: a local path on a laptop, a shared or
object-store path on a cluster), cut into blocks of at most ``window`` lines and, for a local
file, at most lines / ``actors`` (rounded up), so that a file smaller than actors x window is
still ``actors`` blocks; each block goes to one of ``actors`` actors (Ray picks which). Each answer carries
the actor that made it: the driver reports how many lines each actor answered. Each actor holds one engine (server/batch/inprocess.py: the model, its
scheduler and the server's app, built once) and runs the single-process job on its block
(server/batch/job.py: the same prefix grouping, the same per-line errors), returning the answer
lines in block order. With Ray Data's ``preserve_order`` the driver receives the blocks in input
order and writes each as one chunk (server/batch/output.py), so the output file is the one the
single-process command writes for the same input, line for line.

What differs from the single-process command: an error line for a line without a custom_id has
``error.line`` null (a block does not know its place in the file); a repeated custom_id is found
only within a block; and there is no resume: the output file is written anew.

``ray`` is imported only when a pipeline runs: the rest of radixserve never needs it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import io
import math
import os
import threading
from typing import Any

from server.batch.job import Job, Options
from server.batch.output import ChunkWriter


WAIT_FOR_ACTORS_S = 3600  # actors loading their models (a hub download included); a bound against a hang only


class BlockWorker:
    """A Ray Data actor: one engine for the actor's life, the batch job on each block of lines."""

    def __init__(self, model: str, flags: dict[str, Any], options: Options) -> None:
        from server.batch.inprocess import Engine
        from server.config import ServerConfig

        self.options = dataclasses.replace(options, numbered=False)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="radixserve-batch-loop", daemon=True).start()
        self.engine = Engine.build(ServerConfig(model_id=model, **flags))
        asyncio.run_coroutine_threadsafe(self.engine.__aenter__(), self.loop).result()
        self.name = f"pid {os.getpid()}"  # one actor, one process

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        texts = [str(t) for t in batch["text"]]
        data = ("\n".join(texts) + "\n").encode("utf-8")
        sink = io.BytesIO()
        job = Job(self.engine, ChunkWriter(sink, sync=False),
                  options=dataclasses.replace(self.options, window=max(1, len(texts))))
        asyncio.run_coroutine_threadsafe(job.run(io.BytesIO(data)), self.loop).result()
        answers = sink.getvalue().decode("utf-8").splitlines()
        return {"answer": answers, "actor": [self.name] * len(answers)}


def blocks(path: str, *, window: int, actors: int) -> tuple[int, int | None]:
    """(lines per block, number of blocks): at most ``window`` lines per block, and at most a local
    file's lines / ``actors``; the number is None for a path that is not a local file (not counted)."""
    if not os.path.isfile(path):
        return window, None
    from server.batch.lines import count_lines

    n = count_lines(path)
    size = max(1, min(window, math.ceil(n / actors)))
    return size, max(1, math.ceil(n / size))


def run_ray(input_path: str, output_path: str, *, model: str, flags: dict[str, Any] | None = None,
            actors: int = 2, options: Options = Options(), cpus_per_actor: float | None = None,
            gpus_per_actor: float = 0.0) -> dict[str, Any]:
    """Answer ``input_path`` into ``output_path`` on the Ray cluster ``ray.init`` connects to
    (a local one when none runs); ``flags``: ServerConfig fields (e.g. ``{"device": "cpu"}``).

    ``cpus_per_actor`` None: min(1, (the cluster's CPUs - 1) / actors), at least 0.1, so the
    actors leave one whole CPU to the read tasks that feed them (a read task takes one; if the
    actors held them all, a 2-core laptop with two actors would wait forever).

    Returns ``{"lines", "failed", "block": lines per block, "actors": {actor: lines it answered}}``.
    """
    import ray
    import ray.data

    if not ray.is_initialized():
        ray.init()
    if cpus_per_actor is None:
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        cpus_per_actor = min(1.0, max(0.1, (cpus - 1.0) / actors))
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # blocks reach the driver in input order
    if hasattr(ctx, "wait_for_min_actors_s"):  # Ray >= 2.10: every actor loads its model before a block goes
        ctx.wait_for_min_actors_s = WAIT_FOR_ACTORS_S  # out, or the first one up would take them all
    block, count = blocks(input_path, window=options.window, actors=actors)
    data = ray.data.read_text(input_path)
    if count is not None:  # a file is read as one block: cut, or one actor would run it all
        data = data.repartition(count)  # no shuffle: blocks keep the input order
    answers = data.map_batches(
        BlockWorker, fn_constructor_kwargs={"model": model, "flags": dict(flags or {}), "options": options},
        batch_size=block, compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1), num_cpus=cpus_per_actor,
        num_gpus=gpus_per_actor, batch_format="numpy",
    )
    lines = failed = 0
    per_actor: dict[str, int] = {}
    writer = ChunkWriter(open(output_path, "wb"), sync=True, name=output_path)
    try:
        for got in answers.iter_batches(batch_size=None, batch_format="numpy"):
            out = [str(a).encode("utf-8") + b"\n" for a in got["answer"]]
            writer.write_chunk(out)
            lines += len(out)
            failed += sum(not a.endswith(b'"error":null}\n') for a in out)  # "error" is each line's last key
            for actor in got["actor"]:
                per_actor[str(actor)] = per_actor.get(str(actor), 0) + 1
    finally:
        writer.close()
    return {"lines": lines, "failed": failed, "block": block, "actors": per_actor}

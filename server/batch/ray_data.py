"""The batch job on a Ray cluster: a Ray Data pipeline with one engine per actor.

  radixserve-batch -i requests.jsonl -o results.jsonl --model DIR --ray-actors 4
  # or from Python:
  from server.batch.ray_data import run_ray
  run_ray("requests.jsonl", "results.jsonl", model="Qwen/Qwen3-Reranker-0.6B", actors=4)

The input is read as text lines (``ray.data.read_text``: a local path on a laptop, a shared or
object-store path on a cluster), cut into blocks of ``window`` lines, and each block goes to one
of ``actors`` actors. Each actor holds one engine (server/batch/inprocess.py: the model, its
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
import threading
from typing import Any

from server.batch.job import Job, Options
from server.batch.output import ChunkWriter


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

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        texts = [str(t) for t in batch["text"]]
        data = ("\n".join(texts) + "\n").encode("utf-8")
        sink = io.BytesIO()
        job = Job(self.engine, ChunkWriter(sink, sync=False),
                  options=dataclasses.replace(self.options, window=max(1, len(texts))))
        asyncio.run_coroutine_threadsafe(job.run(io.BytesIO(data)), self.loop).result()
        return {"answer": sink.getvalue().decode("utf-8").splitlines()}


def run_ray(input_path: str, output_path: str, *, model: str, flags: dict[str, Any] | None = None,
            actors: int = 2, options: Options = Options(), cpus_per_actor: float | None = None,
            gpus_per_actor: float = 0.0) -> dict[str, int]:
    """Answer ``input_path`` into ``output_path`` on the Ray cluster ``ray.init`` connects to
    (a local one when none runs); ``flags``: ServerConfig fields (e.g. ``{"device": "cpu"}``).

    ``cpus_per_actor`` None: min(1, (the cluster's CPUs - 1) / actors), at least 0.1, so the
    actors leave one whole CPU to the read tasks that feed them (a read task takes one; if the
    actors held them all, a 2-core laptop with two actors would wait forever).
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
    answers = ray.data.read_text(input_path).map_batches(
        BlockWorker, fn_constructor_kwargs={"model": model, "flags": dict(flags or {}), "options": options},
        batch_size=options.window, compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=cpus_per_actor,
        num_gpus=gpus_per_actor, batch_format="numpy",
    )
    lines = failed = 0
    writer = ChunkWriter(open(output_path, "wb"), sync=True)
    try:
        for block in answers.iter_batches(batch_size=None, batch_format="numpy"):
            out = [str(a).encode("utf-8") + b"\n" for a in block["answer"]]
            writer.write_chunk(out)
            lines += len(out)
            failed += sum(not a.endswith(b'"error":null}\n') for a in out)  # "error" is each line's last key
    finally:
        writer.close()
    return {"lines": lines, "failed": failed}

"""The in-process reference for full load: items/s of the embed-template requests through the runner.

    python -m benchmarks.bench_front forward-rate --model-dir DIR --queries 64

Tokenizes every request first, then runs ``runner.prepare`` + ``runner.run`` batch after batch on
a thread of its own (as the server's forwards run), so the rate is what a server at full load,
one request per batch, should approach (docs/performance/cpu.md, "Against Infinity").
"""
from __future__ import annotations

import threading
import time

import numpy as np


def forward_rate(model_dir: str, *, queries: int = 64, seed: int = 0, threshold: float = 1.0,
                 cache: str = "0", rounds: int = 1) -> dict:
    """Items/s of the embed-template requests (64 items each, one batch per request) through the
    runner in process (tokenize, prepare, run): the rate a server at full load should approach."""
    import models
    from loadtest import datasets, workloads
    from models.text import prompts
    runner = models.load_runner(model_dir, device="cpu", dtype="float32", radix_mlp_threshold=threshold,
                                prefix_cache_size=cache, keep_dense_weights=False)  # as the server loads it
    reqs = workloads.build_requests(datasets.synthetic(queries, seed=seed), "embed-template")
    prompt = prompts.resolve_prompt(runner.prompts or {}, prompt_name=None,
                                    default_prompt_name=runner.default_prompt_name, default_prompt=None)
    batches = []
    for r in reqs:
        ids = prompts.encode_embedding_inputs(runner.tokenizer, r.body["input"], prompt=prompt,
                                              max_length=runner.max_positions, truncate=True)
        lens = [len(i) for i in ids]
        flat = np.fromiter((t for i in ids for t in i), dtype=np.int32)
        batches.append((flat, np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)))
    runner.run(runner.prepare(*batches[0]))  # warm
    got: dict = {}

    def loop() -> None:
        items, running, t0 = 0, 0.0, time.perf_counter()
        for _ in range(rounds):
            for flat, cu in batches:
                prepared = runner.prepare(flat, cu)
                t1 = time.perf_counter()
                runner.run(prepared)
                running += time.perf_counter() - t1
                items += len(cu) - 1
        got.update(items=items, running=running, spent=time.perf_counter() - t0)

    # NOTE: on a thread of its own, as the server's forwards run (rs-prep / rs-worker): with glibc
    # a non-main thread allocates from its own arena, and the compact forward measured ~5% slower there.
    worker = threading.Thread(target=loop, name="rs-worker")
    worker.start()
    worker.join()
    items, running, spent = got["items"], got["running"], got["spent"]
    return {"requests": len(batches) * rounds, "items": items, "seconds": round(spent, 2),
            "items_per_s": round(items / spent, 2), "items_per_s_run_only": round(items / running, 2),
            "radix_mlp_threshold": threshold, "prefix_cache": cache}

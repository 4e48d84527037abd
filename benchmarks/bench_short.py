"""Many short sequences on the CPU: ``sdpa_varlen``'s batched calls (``short_plan``) against its
per-run calls, over the tiny fixture's whole forward, alternating batch by batch.

    python -m benchmarks.bench_short [--preset tiny-embedding [--layers N]] [--threads 1] [--repeats 12]

Four batches of 64 items from the load tester's synthetic data: bare queries (no sharing: radix
off), queries behind the embedding query prompt (compact; with tree attention `auto` and `off`)
and templated query-passage pairs (compact, tree off). Prints the median CPU time of the calling
thread per forward (``time.thread_time``: steadier than wall time on a busy machine) and how many
batched calls a forward made. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np


def batches(runner, n: int = 64) -> list[tuple[str, str, list[str]]]:
    from loadtest import datasets, workloads

    ds = datasets.synthetic(n, seed=0)
    queries = [s.query for s in ds.samples]
    prompted = [workloads.query_prompt() + q for q in queries]
    pairs = [workloads.render_pair(s.query, p) for s in ds.samples for p in s.passages][:n]
    return [("bare queries", "auto", queries), ("queries + prompt", "auto", prompted),
            ("queries + prompt, tree off", "off", prompted), ("template pairs, tree off", "off", pairs)]


def bench(preset: str = "tiny-embedding", *, layers: int | None = None, threads: int = 1,
          repeats: int = 12) -> list[dict]:
    import torch

    import models
    import models.attention.varlen as attention
    import fixtures
    from models.text import prompts
    torch.set_num_threads(threads)
    base = models.load_runner(str(fixtures.cached(preset, layers=layers)), device="cpu", dtype="float32", prefix_cache_size=0)
    calls: list[int] = []
    real = attention._short_buckets

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    attention._short_buckets = counted  # type: ignore[assignment]
    min_batched = attention.SHORT_MIN
    rows = []
    try:
        for name, tree, texts in batches(base):
            runner = dataclasses.replace(base, tree_attention=tree)
            ids = prompts.encode_embedding_inputs(runner.tokenizer, texts, prompt="", max_length=512, truncate=True)
            flat = np.concatenate([np.asarray(i, np.int32) for i in ids])
            cu = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int32)
            cpu: dict[str, list[float]] = {"per-run": [], "batched": []}
            made = 0
            for rep in range(repeats + 2):
                for way in ("per-run", "batched"):
                    attention.SHORT_MIN = 10 ** 9 if way == "per-run" else min_batched
                    prepared = runner.prepare(flat, cu)
                    calls.clear()
                    t0 = time.thread_time()
                    runner.run(prepared)
                    if rep >= 2:  # the first two rounds warm up
                        cpu[way].append(time.thread_time() - t0)
                    made = len(calls) if way == "batched" else made
            per_run, batched = (statistics.median(cpu[w]) * 1e3 for w in ("per-run", "batched"))
            rows.append({"batch": name, "tokens": int(cu[-1]), "per_run_ms": round(per_run, 2),
                         "batched_ms": round(batched, 2), "ratio": round(batched / per_run, 3),
                         "batched_calls_per_forward": made})
    finally:
        attention._short_buckets = real  # type: ignore[assignment]
        attention.SHORT_MIN = min_batched
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_short", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-embedding")
    ap.add_argument("--layers", type=int, default=None, help="cut the preset to this many layers")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=12)
    a = ap.parse_args(argv)
    for row in bench(a.preset, layers=a.layers, threads=a.threads, repeats=a.repeats):
        print(json.dumps(row))


if __name__ == "__main__":
    main()

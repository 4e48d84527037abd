"""The prefix cache's host bookkeeping alone: what `plan` and `commit` cost per token, and what the
model worker's thread does per batch besides the forward.

Two loads, tokenized with the tiny fixtures' (real Qwen3) tokenizer:
- `embed-template`: 64 MS MARCO-shaped pairs per batch rendered in the reranker template and
  embedded (one long shared instruction, every query and passage its own);
- `rerank-100`: one query and 100 passages per batch (the reranker template per pair).
For each load the batches go through a host-only `PrefixCache` (1 layer, 1 head: the pool's size
does not change the bookkeeping) of `--host-capacity` tokens, in the pipeline's order: batch k+1
is planned before batch k is committed, so eviction runs under pressure once the pool is full.
Each step is timed in CPU-seconds of the calling thread (`time.thread_time`), so other processes'
load does not count; the figures are the median of three runs, each with a fresh cache. Then
the runner's own path: `prepare` and `run` with the forward replaced by one that returns zeros of
the right shape; the worker's figure is the CPU time of `run` (all of it is host work outside the
forward). Last, the same batches through a real `Scheduler` (one request per batch, 4 in flight,
forwards on the worker): the CPU time of each of its threads per batch, read from the threads'
own clocks (`pthread_getcpuclockid`); the worker's is its whole host time per batch outside the
(zero-cost) forward. With `--host-block`, plan and commit alone on other block sizes of the same
pool, and the hit rate of each load sent twice through a `--host-repeat-capacity` pool (what
larger blocks cost in pool space).

    python -m benchmarks.bench_cache --host
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
import threading
import time

import numpy as np
import torch

from loadtest.datasets import synthetic
from models.prefix_cache import PrefixCache
from models.text.prompts import RerankTemplate
from server.process import freeze_startup_objects


def _pack(seqs) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


def rerank_batches(runner, *, n: int, seed: int) -> list[list[list[int]]]:
    """n batches of one query and 100 passages each, in the reranker template."""
    data = synthetic(n, seed=seed, passages_per_query=(100, 100)).samples
    tmpl = RerankTemplate(runner.tokenizer)
    return [tmpl.encode(s.query, s.passages, max_length=8192, truncate=True) for s in data[:n]]


def cache_cost(batches, *, capacity: int, block: int = 16) -> dict[str, float]:
    """CPU-seconds per 1M tokens of plan and of commit over `batches` (each planned before the
    previous one commits), with the hit rate and evictions, on a pool of `block`-token blocks."""
    cache = PrefixCache(layers=1, kv_heads=1, head_dim=2, capacity=capacity, dtype=torch.float32,
                        device="cpu", block=block)
    packed = [_pack(seqs) for seqs in batches]
    plan_s = commit_s = 0.0
    held = None
    tokens = 0
    for ids, cu in packed:
        t0 = time.thread_time()
        lease = cache.plan(ids, cu)
        t1 = time.thread_time()
        if held is not None:
            cache.commit(held)
        t2 = time.thread_time()
        plan_s, commit_s = plan_s + t1 - t0, commit_s + t2 - t1
        lease.hits = int(lease.matched.sum())
        lease.misses = int(cu[-1]) - lease.hits
        tokens += int(cu[-1])
        held = lease
    t0 = time.thread_time()
    if held is not None:
        cache.commit(held)
    commit_s += time.thread_time() - t0
    st = cache.stats()
    per = 1e6 / tokens
    return {"plan": plan_s * per, "commit": commit_s * per, "tokens_per_batch": tokens / len(packed),
            "hit": st["hit_tokens"] / max(1, st["hit_tokens"] + st["miss_tokens"]),
            "evictions": st["evictions"]}


def worker_cost(runner, batches, *, capacity: int) -> dict[str, float]:
    """ms of CPU per batch: the runner's `run` with a zero-cost forward (the worker's share), and
    `prepare` (the prep thread's), with the runner's prefix cache of `capacity` tokens."""
    fast = _zero_forward(runner, capacity)
    run_s = prep_s = 0.0
    held = None
    for k, seqs in enumerate(batches):
        t0 = time.thread_time()
        prepared = fast.prepare(*_pack(seqs))
        t1 = time.thread_time()
        if held is not None:
            fast.run(held)
        t2 = time.thread_time()
        if k:  # the first batch warms up
            prep_s, run_s = prep_s + t1 - t0, run_s + t2 - t1
        held = prepared
    fast.run(held)
    assert fast.prefix_cache is not None
    fast.prefix_cache.stats()  # settles whatever is left
    n = max(1, len(batches) - 1)
    return {"run_ms": run_s / n * 1e3, "prepare_ms": prep_s / n * 1e3}


def _zero_forward(runner, capacity: int):
    """A copy of `runner` whose forward costs nothing, with a fresh prefix cache of `capacity` tokens."""
    cache = PrefixCache(layers=runner.config.num_hidden_layers, kv_heads=runner.config.num_key_value_heads,
                        head_dim=runner.config.head_dim, capacity=capacity, dtype=runner.dtype,
                        device=runner.device)
    fast = dataclasses.replace(runner, prefix_cache=cache, radix_mlp_threshold=0.95)
    width = () if runner.kind == "reranker" else (runner.hidden_size,)
    fast.forward = lambda batch: torch.zeros((batch.num_seqs, *width))
    return fast


def _thread_cpu(names: tuple[str, ...]) -> dict[str, float]:
    """CPU-seconds so far of the live threads with these names (their own clocks)."""
    out = {}
    for t in threading.enumerate():
        if t.name in names and t.ident is not None:
            try:
                out[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:  # exited meanwhile
                pass
    return out


def pipeline_cost(runner, batches, *, capacity: int, concurrency: int = 4) -> dict[str, float]:
    """ms of CPU per batch on each scheduler thread (prep, worker, settle) with a zero-cost forward:
    every batch one request, `concurrency` in flight, forwards on the worker (inline off)."""
    from scheduler import Scheduler

    fast = _zero_forward(runner, capacity)
    names = ("rs-prep", "rs-worker", "rs-settle")
    # NOTE: the largest request as the batch limit: no two requests of the load fit one batch
    sched = Scheduler(fast, max_batch_tokens=max(sum(map(len, b)) for b in batches), inline=False)
    sched.start()

    async def go():
        gate = asyncio.Semaphore(concurrency)

        async def one(items):
            async with gate:
                await sched.submit(items)

        await one(batches[0])  # the first batch warms up
        before = _thread_cpu(names)
        await asyncio.gather(*(one(b) for b in batches[1:]))
        after = _thread_cpu(names)
        return before, after

    try:
        before, after = asyncio.run(go())
    finally:
        sched.stop()
    n = max(1, len(batches) - 1)
    return {name: (after.get(name, 0.0) - before.get(name, 0.0)) / n * 1e3 for name in names}


def host_main(args) -> int:
    from benchmarks.cache_workloads import workload_batches
    import fixtures
    from models.runner import load_runner

    print(f"# prefix cache host cost: {args.host_batches} batches per load, pool {args.host_capacity} "
          f"tokens; CPU-seconds of the calling thread")
    print(f"{'load':>15} {'tok/b':>7} {'hit':>5} {'evict':>6} {'plan s/1M':>10} {'commit s/1M':>11} "
          f"{'prepare ms/b':>12} {'run ms/b':>9} | scheduler ms/b: {'prep':>6} {'worker':>6} {'settle':>6}")
    for load, preset in (("embed-template", "tiny-embedding"), ("rerank-100", "tiny-reranker")):
        path = fixtures.cached(preset, root=args.fixture_root)  # the bookkeeping is the same at any size
        runner = load_runner(str(path), device="cpu", dtype="float32", prefix_cache_size=0)
        if load == "embed-template":
            batches = workload_batches(load, runner, n=args.host_batches, seed=args.seed)
        else:
            batches = rerank_batches(runner, n=args.host_batches, seed=args.seed)
        # the median of 3 fresh caches: a cyclic-GC pass lands in whichever call allocates
        runs = [cache_cost(batches, capacity=args.host_capacity) for _ in range(3)]
        c = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        w = worker_cost(runner, batches, capacity=args.host_capacity)
        # NOTE: as the server does after start-up (server/process.py): without it a full collection,
        # walking every module and tensor loaded so far (~200 ms here), lands on whichever scheduler
        # thread allocates when it is due and adds ~20 ms to that run's per-batch figure
        freeze_startup_objects()
        p = pipeline_cost(runner, batches, capacity=args.host_capacity)
        print(f"{load:>15} {c['tokens_per_batch']:>7.0f} {c['hit']:>5.2f} {c['evictions']:>6.0f} "
              f"{c['plan']:>10.3f} {c['commit']:>11.3f} {w['prepare_ms']:>12.2f} {w['run_ms']:>9.3f} | "
              f"{'':>15} {p['rs-prep']:>6.2f} {p['rs-worker']:>6.3f} {p['rs-settle']:>6.3f}")
        if args.host_block != [16]:
            # the same pool in tokens cut into other blocks: plan and commit alone, then the hit rate
            # of the load sent twice through a pool that holds about half of it (a tail or a block a
            # sequence diverges in holds a whole slot, so larger blocks hold fewer sequences)
            twice = args.host_repeat_capacity
            for block in args.host_block:
                runs = [cache_cost(batches, capacity=args.host_capacity, block=block) for _ in range(3)]
                c = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                again = cache_cost(batches + batches, capacity=twice, block=block)["hit"]
                print(f"{'  block ' + str(block):>15} {'':>7} {c['hit']:>5.2f} {c['evictions']:>6.0f} "
                      f"{c['plan']:>10.3f} {c['commit']:>11.3f}   hit {again:.2f} with the load twice, pool {twice}")
    return 0

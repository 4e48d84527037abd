"""Concurrency-1 runs that take turns between targets, request by request (`compare --alternate`).

Run one after another, targets meet whatever the machine is doing during their own minutes: on a
shared or noisy host a slow spell lands on one of them and moves the ratio by more than the
difference being measured (two sequential runs of one pair of configurations can differ by more
than 10%). At concurrency 1 exactly one request is in flight
anywhere, so the targets can take turns at no cost to fairness: request i goes to every target
before request i+1 goes to any, in an order shuffled afresh each round (``turn_order``). A slow
spell then hits all targets alike, and so does what ran just before a request. Every target sees
the same requests in the same order, so its own state (a prefix cache, a warm allocator) evolves
as it would in a run of its own.

Each target has its own connection, warm-up and /metrics deltas. A target's wall time is the sum
of its own requests' times (closed loop at concurrency 1: what it would take alone), so its
requests per second are answered requests over that sum, and its completion offsets run on
that clock too. Only for concurrency 1: with several
requests in flight the targets would share the machine's cores while running, and the ratios
would measure that contention instead.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time

import httpx

from loadtest import scrape
from loadtest.client import (Progress, RunConfig, RunResult, check_url, measured_requests, record, scrape_metrics,
                             send, warmup_requests)
from loadtest.workloads import Request


def turn_order(round_index: int, n: int, seed: int = 0) -> list[int]:
    """Target order in round `round_index`: a shuffle of range(n), the same for the same seed and round.

    What ran just before a request shapes its time (the caches and the CPU state the previous
    target left), so no target may always follow the same one: with a fixed rotation each target's
    predecessor was fixed, and of three or more targets two running the same code measured apart
    (docs/performance/latency.md, "The instrument")."""
    return random.Random(f"{seed}:{round_index}").sample(range(n), n)


async def run_async(requests: list[Request], cfg: RunConfig, urls: list[str]) -> list[RunResult]:
    """One RunResult per URL, in the order given. cfg.url is ignored; cfg.concurrency must be 1.
    cfg.requests / cfg.duration bound the rounds (a round sends one request to every target; a
    round once started is finished, so every target gets the same requests)."""
    if not requests:
        raise ValueError("no requests to send")
    if cfg.concurrency != 1:
        raise ValueError(f"alternating targets sends one request at a time: concurrency must be 1, "
                         f"got {cfg.concurrency}")
    if not urls:
        raise ValueError("need at least one target URL")
    urls = [check_url(u) for u in urls]
    measured = measured_requests(requests, cfg)
    limit = cfg.requests if cfg.requests is not None else (None if cfg.duration else len(measured))
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    results = [RunResult(distinct=len(measured)) for _ in urls]
    busy = [0.0] * len(urls)  # seconds each target spent answering its measured requests
    one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(timeout=cfg.timeout, limits=one,
                                                                     headers=headers)) for _ in urls]
        for i, warm in enumerate(warmup_requests(requests, cfg)):  # none of them is measured
            for k in turn_order(i, len(urls)):
                await send(clients[k], urls[k], warm)
        before = [await scrape_metrics(c, u) for c, u in zip(clients, urls)]
        progress = Progress(cfg.progress, total=limit, duration=cfg.duration)
        ticker = asyncio.create_task(progress.tick())
        start = progress.start = time.perf_counter()
        deadline = start + cfg.duration if cfg.duration else None
        i = 0
        try:
            while (limit is None or i < limit) and (deadline is None or time.perf_counter() < deadline):
                req = measured[i % len(measured)]
                for k in turn_order(cfg.warmup + i, len(urls)):  # warm-up rounds came first
                    results[k].sent += 1
                    status, seconds = await send(clients[k], urls[k], req)
                    busy[k] += seconds
                    record(results[k], req, status, seconds, busy[k])
                progress.update(sum(sum(r.errors.values()) for r in results))
                i += 1
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            progress.close()
        after = [await scrape_metrics(c, u) for c, u in zip(clients, urls)]
    for res, spent, b, a in zip(results, busy, before, after):
        res.wall_s = spent
        res.metrics = scrape.delta(b, a)
    return results


def run(requests: list[Request], cfg: RunConfig, urls: list[str]) -> list[RunResult]:
    return asyncio.run(run_async(requests, cfg, urls))

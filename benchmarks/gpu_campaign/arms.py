"""The arms of one end-to-end comparison side by side: every arm's server up at once, the load
taking turns between them in short slices, so a slow spell of the host or the device lands on
every arm alike and each ratio comes from one run.

Round r gives each arm `s.slice_s` seconds of load at the campaign's concurrency, in an order
shuffled afresh each round (loadtest.alternate.turn_order); `s.rounds` rounds. Each arm replays
the same request list from its start and goes on where its previous slice stopped, so it never
sees a request twice (its prefix cache answers nothing from an earlier slice) and every arm sees
the same requests in the same order. The warm-up is the first slice's first `s.warmup` requests,
not sent again. One server start per arm: the cache arm starts last, so its `auto` size is taken
from what the other arms left free after their own warm-ups.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from pathlib import Path

from benchmarks.gpu_campaign import e2e, plan
from benchmarks.gpu_campaign.gpu_busy import BusySampler
from loadtest import client, report, scrape
from loadtest.alternate import turn_order


def merge(results: list[client.RunResult]) -> client.RunResult:
    """The slices of one arm as one run: latencies, items, requests, seconds and /metrics deltas
    added up (the mean N'/N weighted by each slice's batches)."""
    out = client.RunResult(distinct=results[0].distinct if results else 0)
    errors: Counter = Counter()
    offset = 0.0
    for r in results:
        out.latencies_s += r.latencies_s
        out.completions_s += [offset + c for c in r.completions_s]
        offset += r.wall_s
        errors.update(r.errors)
        out.items_ok += r.items_ok
        out.sent += r.sent
        out.wall_s += r.wall_s
        out.client_cpu_s += r.client_cpu_s
    out.errors = errors
    deltas = [r.metrics for r in results]

    def total(name: str) -> float | None:
        values = [getattr(d, name) for d in deltas]
        return None if not values or any(v is None for v in values) else float(sum(values))

    batches = total("batches")
    ratio_sum = (sum(d.mean_ratio * d.batches for d in deltas if d.batches)
                 if batches and all(d.mean_ratio is not None or not d.batches for d in deltas) else None)
    out.metrics = scrape.MetricsDelta(batches=batches, mean_ratio=ratio_sum / batches if ratio_sum is not None else None,
                                      tokens_original=total("tokens_original"), tokens_compact=total("tokens_compact"),
                                      cache_hit=total("cache_hit"), cache_miss=total("cache_miss"))
    return out


def side_by_side(s: plan.Sizes, model_dir: Path, *, arms: list[str], logs: Path, work: Path, deadline_at: float,
                 role: str) -> dict:
    """Every arm in `arms` served at once and loaded in turns; one summary per arm (as `e2e.arm`'s)
    plus the rounds actually run (fewer when the deadline is near: every arm of a round is run)."""
    reqs = e2e.request_list(s, s.rounds * s.slice_s, work)
    order = sorted(arms, key=lambda a: a == "compact+cache")  # the cache arm starts last
    with contextlib.ExitStack() as stack:
        servers, startup = {}, {}
        for arm in order:
            t0 = time.monotonic()
            servers[arm] = stack.enter_context(e2e._server(model_dir, f"{role}-{arm}", plan.server_flags(arm, s), logs,
                                                           startup_s=max(10.0, deadline_at - time.time())))
            startup[arm] = time.monotonic() - t0
        slices: dict[str, list[client.RunResult]] = {a: [] for a in arms}
        busy: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
        offset = {a: 0 for a in arms}
        rounds = 0
        for r in range(s.rounds):
            # a round is started only when all its slices fit before the scrape and the servers' stop
            if r and time.time() + len(arms) * (s.slice_s + 2.0) > deadline_at - 15.0:
                break
            for k in turn_order(r, len(arms)):
                arm = arms[k]
                first = offset[arm] == 0
                part = reqs[offset[arm]:]
                if len(part) <= (s.warmup if first else 0):
                    continue  # the list is spent for this arm (queries_for sizes it so it is not)
                cfg = client.RunConfig(url=servers[arm].url, concurrency=plan.CONCURRENCY,
                                       requests=len(part) - (s.warmup if first else 0), duration=s.slice_s,
                                       warmup=s.warmup if first else 0, timeout=300.0, progress=False,
                                       warmup_continues=first)
                with BusySampler(s.device) as sampler:
                    res = client.run(part, cfg)
                slices[arm].append(res)
                if sampler.share is not None:
                    busy[arm].append((sampler.share, res.wall_s))
                offset[arm] += res.sent + (s.warmup if first else 0)
            rounds += 1
    rows = []
    for arm in arms:
        merged = merge(slices[arm])
        merged = dataclasses.replace(merged, distinct=len(reqs) - s.warmup)
        summary = report.summarize(merged, name=arm, meta={
            "flags": " ".join(plan.ARMS[arm]), "cache": plan.CACHE_STATE[arm], "startup_s": round(startup[arm], 1),
            "duration": merged.wall_s, "rounds": rounds, "slice_s": s.slice_s})
        summary.pop("latencies_ms", None)
        weight = sum(w for _, w in busy[arm])
        summary["gpu_busy"] = sum(b * w for b, w in busy[arm]) / weight if weight else None
        rows.append(summary)
    return {"arms": rows, "rounds": rounds, "slice_s": s.slice_s, "requests": len(reqs)}

"""Summaries of load-test runs: latency percentiles, throughput, server-side compression, errors.

Percentiles use linear interpolation between closest ranks, numpy's default ("linear", type 7):
for sorted x[0..n-1] and p in [0, 100], h = (n-1)*p/100 and
P = x[floor h] + (h - floor h) * (x[floor h + 1] - x[floor h]).
Throughput divides by the run's wall time (first send to last answer), not by summed latency.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from loadtest import machine
from loadtest.client import RunResult


def percentile(values, p: float) -> float:
    """Linear-interpolation percentile (numpy default); NaN for an empty sample."""
    if not 0.0 <= p <= 100.0:
        raise ValueError("p must be within [0, 100]")
    xs = sorted(values)
    if not xs:
        return math.nan
    h = (len(xs) - 1) * p / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def _rate(x: float | None, wall: float) -> float | None:
    return None if x is None or wall <= 0 else x / wall


def repeat_warnings(summaries: list[dict]) -> list[str]:
    """One line per run that went round its request list more than once: a server with a prefix
    cache answers the repeats from the cache, so its figures would be better than fresh traffic's."""
    return [f"{s['name']}: {s['requests_sent']} requests sent from a list of {s['distinct_requests']} "
            f"({s['passes']:.1f} passes): the repeats are served whole by a prefix cache; "
            f"raise --queries for figures without repeats"
            for s in summaries if s.get("passes") and s["passes"] > 1]


def summarize(result: RunResult, *, name: str, meta: dict | None = None) -> dict:
    """A JSON-ready summary of one run. Latencies in milliseconds."""
    lat = result.latencies_s
    m = result.metrics
    wall = result.wall_s
    ms = lambda v: None if math.isnan(v) else 1000.0 * v  # noqa: E731
    return {
        "name": name,
        **(meta or {}),
        "requests_ok": result.ok,
        "requests_sent": result.sent,
        "distinct_requests": result.distinct,
        "passes": result.sent / result.distinct if result.distinct else None,  # > 1: requests repeated
        "errors": dict(sorted(result.errors.items())),
        "error_count": sum(result.errors.values()),
        "wall_s": wall,
        # the load client's CPU seconds per wall second (1.0 = one core busy): near 1, the client set the pace
        "client_cpu_share": result.client_cpu_s / wall if wall > 0 else None,
        "latency_ms": {
            "p50": ms(percentile(lat, 50)),
            "p90": ms(percentile(lat, 90)),
            "p99": ms(percentile(lat, 99)),
            "mean": ms(sum(lat) / len(lat)) if lat else None,
            "max": ms(max(lat)) if lat else None,
        },
        "requests_per_s": _rate(result.ok, wall),
        "items_per_s": _rate(result.items_ok, wall),
        "tokens_per_s": _rate(m.tokens_original, wall),
        "compact_tokens_per_s": _rate(m.tokens_compact, wall),
        "server": {
            "batches": m.batches,
            "mean_compression_ratio": m.mean_ratio,
            "token_compression_ratio": m.token_ratio,
            "tokens_original": m.tokens_original,
            "tokens_compact": m.tokens_compact,
            "prefix_cache_hit_tokens": m.cache_hit,  # 0 with the cache off; None: no such series (a peer)
            "prefix_cache_miss_tokens": m.cache_miss,
        },
        # Kept for plots (latency CDF); small: one float per successful request.
        "latencies_ms": [1000.0 * v for v in lat],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else a / b


def speedups(summaries: list[dict]) -> list[dict]:
    """Each run against the first: throughput ratio (higher is better) and p50/p99 ratios
    (first / this, so > 1 also means this one is faster)."""
    base = summaries[0]
    out = []
    for s in summaries:
        out.append({
            "name": s["name"],
            "throughput": _ratio(s["items_per_s"], base["items_per_s"]),
            "p50": _ratio(base["latency_ms"]["p50"], s["latency_ms"]["p50"]),
            "p99": _ratio(base["latency_ms"]["p99"], s["latency_ms"]["p99"]),
        })
    return out


def _f(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown(summaries: list[dict], *, title: str = "radixserve load test") -> str:
    """A Markdown table of the runs (plus speedups vs the first when there are several)."""
    first = summaries[0]
    lines = [f"# {title}", ""]
    for key in ("workload", "source", "order", "concurrency", "batch_size", "chunking", "requests", "duration"):
        if key in first and first[key] is not None:
            lines.append(f"- {key}: {first[key]}")
    if first.get("machine"):
        lines.append(f"- machine: {machine.line(first['machine'])}")
    lines += [
        "",
        "| target | ok | errors | req/s | items/s | tokens/s | p50 ms | p90 ms | p99 ms | mean ms | ratio N'/N |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lat = s["latency_ms"]
        errs = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "0"
        lines.append(
            f"| {s['name']} | {s['requests_ok']} | {errs} | {_f(s['requests_per_s'], '{:.2f}')} | "
            f"{_f(s['items_per_s'])} | {_f(s['tokens_per_s'], '{:.0f}')} | {_f(lat['p50'])} | "
            f"{_f(lat['p90'])} | {_f(lat['p99'])} | {_f(lat['mean'])} | "
            f"{_f(s['server']['mean_compression_ratio'], '{:.3f}')} |"
        )
    if len(summaries) > 1:
        lines += ["", f"Speedup vs `{first['name']}` (>1 is faster):", "",
                  "| target | throughput | p50 | p99 |", "|---|---|---|---|"]
        for sp in speedups(summaries):
            lines.append(
                f"| {sp['name']} | {_f(sp['throughput'], '{:.2f}x')} | {_f(sp['p50'], '{:.2f}x')} | "
                f"{_f(sp['p99'], '{:.2f}x')} |"
            )
    shares = [(s["name"], s.get("client_cpu_share")) for s in summaries if s.get("client_cpu_share") is not None]
    if shares:
        lines += ["", "Load client CPU (share of one core over the run; near 1 the client set the pace): "
                  + ", ".join(f"{n} {v:.2f}" for n, v in shares) + "."]
    if first.get("alternate"):
        lines += ["", "Targets took turns request by request (all up at once, concurrency 1); req/s is each "
                      "target's answered requests over its own requests' summed time."]
    if str(first.get("source", "")).startswith("synthetic"):
        lines += ["", "Data: synthetic (generated MS MARCO-shaped text, not MS MARCO)."]
    return "\n".join(lines) + "\n"


def write(summaries: list[dict], out_dir: str | Path, *, stem: str = "report", title: str | None = None) -> dict:
    """Write STEM.json and STEM.md into out_dir; returns {"json": path, "md": path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"runs": summaries, "speedups": speedups(summaries) if len(summaries) > 1 else []}
    pj, pm = out / f"{stem}.json", out / f"{stem}.md"
    pj.write_text(json.dumps(doc, indent=2) + "\n")
    pm.write_text(markdown(summaries, title=title or "radixserve load test"))
    return {"json": pj, "md": pm}

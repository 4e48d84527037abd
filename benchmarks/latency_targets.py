"""The one-input latency targets, read off ``bench_latency``'s runs.

docs/performance/latency.md measures a lone one-input request against three targets, on this
kind of box, quiet, raw sockets:

- with the zero-cost forward, the request's p50 within 0.5 ms of ``/health``'s on the same
  connection (``less_health_p50_ms``: the median of the rounds' differences);
- with the real forward, its p50 at most 0.3x the peer's (Infinity's) and its p99 at most 0.4x.

A ratio to a peer follows the machine's pace from one run to the next (the same code measured
0.28x and 0.32x a quarter of an hour apart), so a verdict is a count over runs, not one run's
figure: ``check`` gives, per arm and target, every run's value, their range and in how many runs
it was met. An arm's forward decides which targets apply to it; the peer's own row gets none.
"""
from __future__ import annotations

ZERO_LESS_HEALTH_MS = 0.5  # the zero-cost request's p50 over /health's
REAL_P50_RATIO = 0.3  # the real request's p50 over the peer's
REAL_P99_RATIO = 0.4  # ... and its p99 over the peer's


def check(runs: list[list[dict]], forwards: dict[str, str], peer: str | None) -> list[dict]:
    """``runs``: each run's rows (``bench_latency.summary``'s: server, whole_p50_ms, whole_p99_ms,
    less_health_p50_ms); ``forwards``: each arm's forward ("zero" or "real"; a peer has none);
    ``peer``: the row the real arms' ratios divide by (None: no ratio targets).

    One entry per arm and target: {"server", "target", "unit" ("ms" or "x", a ratio), "values": one
    per run, "met": how many}."""
    out: list[dict] = []
    for name, forward in forwards.items():
        if name == peer:
            continue
        if forward == "zero":
            values = [_row(rows, name)["less_health_p50_ms"] for rows in runs]
            out.append(_entry(name, f"whole less /health p50 <= {ZERO_LESS_HEALTH_MS} ms", values,
                              ZERO_LESS_HEALTH_MS, "ms"))
        elif forward == "real" and peer is not None:
            for key, bound, what in (("whole_p50_ms", REAL_P50_RATIO, "p50"), ("whole_p99_ms", REAL_P99_RATIO, "p99")):
                values = [_row(rows, name)[key] / _row(rows, peer)[key] for rows in runs]
                out.append(_entry(name, f"{what} <= {bound}x {peer}'s", values, bound, "x"))
    return out


def table(entries: list[dict]) -> str:
    """Markdown: one row per arm and target, with the range over the runs and the count met."""
    lines = ["| server | target | each run | range | met |", "|---|---|---|---|---|"]
    for e in entries:
        fmt = (lambda v: f"{v:.3f}x") if e["unit"] == "x" else (lambda v: f"{v:.2f} ms")
        values = e["values"]
        lines.append(f"| {e['server']} | {e['target']} | {', '.join(fmt(v) for v in values)} | "
                     f"{fmt(min(values))} - {fmt(max(values))} | {e['met']} of {len(values)} |")
    return "\n".join(lines)


def _entry(server: str, target: str, values: list[float], bound: float, unit: str) -> dict:
    return {"server": server, "target": target, "unit": unit, "values": [round(v, 4) for v in values],
            "met": sum(v <= bound for v in values)}


def _row(rows: list[dict], server: str) -> dict:
    for r in rows:
        if r["server"] == server:
            return r
    raise KeyError(f"no row for {server!r} in this run")

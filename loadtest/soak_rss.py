"""The soak's memory verdict: RSS at the start, peak and end, and its slope, from the samples.

The slope is a least-squares fit of RSS against time (MiB per minute) and against requests sent
(MiB per 1000 requests), over the whole run and over its second half. A server whose memory has
settled shows a second-half slope near zero even when the first half grew (warm-up, caches
filling, the allocator's arenas reaching their working size); a leak shows both slopes positive.
"""
from __future__ import annotations

_MIB = 2 ** 20


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs; None with fewer than 3 points or no spread in xs."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def _rounded(value: float | None, scale: float) -> float | None:
    return None if value is None else round(value * scale, 3)


def rss_summary(samples) -> dict | None:
    """RSS figures of a soak's samples (objects with t_s, rss_bytes, requests); None without RSS."""
    points = [(s.t_s, s.rss_bytes, s.requests) for s in samples if s.rss_bytes is not None]
    if not points:
        return None
    ts, rss, reqs = ([p[i] for p in points] for i in range(3))
    half = points[len(points) // 2:]
    h_ts, h_rss, h_reqs = ([p[i] for p in half] for i in range(3))
    return {
        "start_mib": round(rss[0] / _MIB, 1),
        "peak_mib": round(max(rss) / _MIB, 1),
        "end_mib": round(rss[-1] / _MIB, 1),
        "end_over_start": round(rss[-1] / rss[0], 3),
        # MiB per minute and MiB per 1000 requests: the whole run, then its second half
        "slope_mib_per_min": _rounded(_slope(ts, rss), 60 / _MIB),
        "slope_mib_per_1k_requests": _rounded(_slope(reqs, rss), 1000 / _MIB),
        "second_half_slope_mib_per_min": _rounded(_slope(h_ts, h_rss), 60 / _MIB),
        "second_half_slope_mib_per_1k_requests": _rounded(_slope(h_reqs, h_rss), 1000 / _MIB),
    }


def rss_markdown(summary: dict | None) -> list[str]:
    """The report's RSS lines (a sentence saying why there are none when RSS was not sampled)."""
    if summary is None:
        return ["RSS: not sampled (give --pid, or serve process_* series on /metrics)."]

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:+.2f}"

    s = summary
    return [
        f"RSS: start {s['start_mib']:.1f} MiB, peak {s['peak_mib']:.1f} MiB, end {s['end_mib']:.1f} MiB "
        f"(end/start {s['end_over_start']:.2f}); slope {fmt(s['slope_mib_per_min'])} MiB/min, "
        f"{fmt(s['slope_mib_per_1k_requests'])} MiB per 1000 requests; second half "
        f"{fmt(s['second_half_slope_mib_per_min'])} MiB/min, "
        f"{fmt(s['second_half_slope_mib_per_1k_requests'])} MiB per 1000 requests.",
    ]

"""Benchmark arms against each other round by round.

A benchmark that runs its arms (servers, settings) one right after the other in every round can
take the ratio of each round's pair: a slow spell of a shared machine hits both arms of a round
alike and mostly cancels in their ratio, while the figures summed over all rounds mix rounds of
different speeds. Rows are ``host_ceiling``'s: one per load and arm, with ``per_round`` figures.
"""
from __future__ import annotations

import statistics


def paired(rows: list[dict]) -> list[dict]:
    """Each arm against the first arm of its load, round by round: the two ran one right after the
    other, so a slow spell of the machine hits both and mostly cancels in their ratio. With
    ``--json`` the benchmark prints these after its rows, marked ``"paired": true``.

    Per load and arm: ``cpu_ratios`` (all CPU-seconds per 1M tokens, this arm over the first, per
    round), their median and range, and the ratio of the summed figures; ``wall_ratios`` the same
    for tokens/s (the first over this arm, so above 1 means this arm is slower)."""
    out = []
    for load in dict.fromkeys(r["load"] for r in rows):
        arms = [r for r in rows if r["load"] == load]
        base = arms[0]
        for r in arms[1:]:
            cpu = [b["all_cpu_s_per_1m_tokens"] / x["all_cpu_s_per_1m_tokens"]
                   for b, x in zip(base["per_round"], r["per_round"]) if x["all_cpu_s_per_1m_tokens"]]
            wall = [x["tokens_per_s"] / b["tokens_per_s"]
                    for b, x in zip(base["per_round"], r["per_round"]) if b["tokens_per_s"]]
            out.append({"paired": True, "load": load, "arm": _arm(base), "against": _arm(r),
                        "cpu_ratios": [round(v, 3) for v in cpu],
                        "cpu_ratio_median": round(statistics.median(cpu), 3) if cpu else None,
                        "cpu_ratio_summed": round(base["all_cpu_s_per_1m_tokens"] / r["all_cpu_s_per_1m_tokens"], 3)
                        if r["all_cpu_s_per_1m_tokens"] else None,
                        "wall_ratios": [round(v, 3) for v in wall],
                        "wall_ratio_median": round(statistics.median(wall), 3) if wall else None})
    return out


def _arm(row: dict) -> str:
    tree = f"{row['checkout']}: " if row.get("checkout") else ""
    return f"{tree}--prefix-cache-size {row['prefix_cache_size']} --api-server-count {row['api_server_count']}"


def paired_table(pairs: list[dict]) -> str:
    lines = []
    for p in pairs:
        lines.append(f"{p['load']}: [{p['arm']}] over [{p['against']}], round by round: CPU-s per 1M "
                     f"{' '.join(map(str, p['cpu_ratios']))} (median {p['cpu_ratio_median']}, summed "
                     f"{p['cpu_ratio_summed']}); wall time per token "
                     f"{' '.join(map(str, p['wall_ratios']))} (median {p['wall_ratio_median']})")
    return "\n".join(lines)

"""Read the server's RadixMLP counters from GET /metrics (Prometheus text) and diff two scrapes.

te_radix_mlp_compression_ratio is a histogram of N'/N per batch, so delta(_sum)/delta(_count) is the
mean per-batch ratio over the run; radixserve_tokens_total{kind} deltas give the token-weighted
ratio compact/original and the tokens/s figure; radixserve_prefix_cache_tokens_total{result} deltas
give the tokens read from the prefix cache (hit) and those it did not serve (miss). Missing series
stay None (e.g. the baseline).
Counters only grow within one server process: a counter that went down between the scrapes, or a
changed `te_radix_mlp_compression_ratio_created` (the histogram is made at process start), means
the server restarted, and the deltas are None (unknown), never a negative or partial figure.
Behind a router, `combine` adds the replicas' deltas into one cluster-wide figure.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RATIO = "te_radix_mlp_compression_ratio"
TOKENS = "radixserve_tokens_total"
CACHE = "radixserve_prefix_cache_tokens_total"


@dataclass(frozen=True)
class Snapshot:
    ratio_sum: float | None = None
    ratio_count: float | None = None
    tokens_original: float | None = None
    tokens_compact: float | None = None
    ratio_created: float | None = None  # when the (unlabelled) histogram was made: the process start
    cache_hit: float | None = None
    cache_miss: float | None = None


@dataclass(frozen=True)
class MetricsDelta:
    batches: float | None  # forwards that recorded a ratio during the run
    mean_ratio: float | None  # mean of per-batch N'/N
    tokens_original: float | None
    tokens_compact: float | None
    cache_hit: float | None = None  # tokens read from the prefix cache
    cache_miss: float | None = None  # tokens of cached-path batches the cache did not serve

    @property
    def token_ratio(self) -> float | None:
        """Token-weighted compact/original over the run."""
        if not self.tokens_original or self.tokens_compact is None:
            return None
        return self.tokens_compact / self.tokens_original


def parse(text: str) -> Snapshot:
    """Snapshot of the series we use; labels other than `kind` are summed over."""
    vals: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (RATIO + "_sum", RATIO + "_count", RATIO + "_created"):
                key = s.name
            elif s.name == TOKENS and s.labels.get("kind") in ("original", "compact"):
                key = f"{TOKENS}:{s.labels['kind']}"
            elif s.name == CACHE and s.labels.get("result") in ("hit", "miss"):
                key = f"{CACHE}:{s.labels['result']}"
            else:
                continue
            vals[key] = vals.get(key, 0.0) + float(s.value)
    return Snapshot(
        ratio_sum=vals.get(RATIO + "_sum"),
        ratio_count=vals.get(RATIO + "_count"),
        tokens_original=vals.get(f"{TOKENS}:original"),
        tokens_compact=vals.get(f"{TOKENS}:compact"),
        ratio_created=vals.get(RATIO + "_created"),
        cache_hit=vals.get(f"{CACHE}:hit"),
        cache_miss=vals.get(f"{CACHE}:miss"),
    )


def _sub(a: float | None, b: float | None) -> float | None:
    """Counter delta; None when either side is missing or the counter went down (a reset)."""
    return None if a is None or b is None or a < b else a - b


def delta(before: Snapshot | None, after: Snapshot | None) -> MetricsDelta:
    if before is None or after is None:
        return MetricsDelta(None, None, None, None)
    if before.ratio_created != after.ratio_created:  # another server process answered: unknown
        return MetricsDelta(None, None, None, None)
    n = _sub(after.ratio_count, before.ratio_count)
    s = _sub(after.ratio_sum, before.ratio_sum)
    mean = s / n if n and s is not None else None
    # A labelled counter appears on its first increment: absent before (same process) means 0.
    same_process = before.ratio_created is not None
    zero = 0.0 if same_process else None
    orig_before = before.tokens_original if before.tokens_original is not None else zero
    comp_before = before.tokens_compact if before.tokens_compact is not None else zero
    # ... and absent after too: the process counted none (a replica that took no request)
    orig_after = after.tokens_original if after.tokens_original is not None else zero
    comp_after = after.tokens_compact if after.tokens_compact is not None else zero
    return MetricsDelta(
        batches=n,
        mean_ratio=mean,
        tokens_original=_sub(orig_after, orig_before),
        tokens_compact=_sub(comp_after, comp_before),
        # NOTE: radixserve exports these from start (zeros with the cache off); peers lack them
        cache_hit=_sub(after.cache_hit, before.cache_hit),
        cache_miss=_sub(after.cache_miss, before.cache_miss),
    )


def _add(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values)


def combine(deltas: list[MetricsDelta]) -> MetricsDelta:
    """Several servers' deltas as one (the replicas behind a router): counters add, the mean
    per-batch ratio is weighted by each server's batches. A figure unknown on any server is unknown
    for all (None), never a partial sum."""
    if len(deltas) == 1:
        return deltas[0]
    batches = _add([d.batches for d in deltas])
    # sum of per-batch ratios on each server: mean x batches (a server with no batch adds 0)
    ratio_sums = _add([0.0 if d.batches == 0 else None if d.batches is None or d.mean_ratio is None
                       else d.mean_ratio * d.batches for d in deltas])
    return MetricsDelta(
        batches=batches,
        mean_ratio=ratio_sums / batches if batches and ratio_sums is not None else None,
        tokens_original=_add([d.tokens_original for d in deltas]),
        tokens_compact=_add([d.tokens_compact for d in deltas]),
        cache_hit=_add([d.cache_hit for d in deltas]),
        cache_miss=_add([d.cache_miss for d in deltas]),
    )

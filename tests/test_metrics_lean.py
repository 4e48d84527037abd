"""scheduler/metrics.py's Histogram and Counter against prometheus_client's own: the same values
observed give the same exposition (every sample but the creation time), and misuse fails as the
library's does."""
import math
import random
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as LibCounter
from prometheus_client import Histogram as LibHistogram

from scheduler.metrics import _LATENCY, _RATIO, Counter, Histogram, Metrics


def _text(registry) -> str:
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", generate_latest(registry).decode())


@pytest.mark.parametrize("buckets", [_LATENCY, _RATIO, (1, 2, 4, 8), (-1.0, 0.0, 1.0)])
def test_a_histogram_exposes_what_the_library_would(buckets):
    ours, lib = CollectorRegistry(), CollectorRegistry()
    a = Histogram("h_seconds", "doc", buckets=buckets, registry=ours)
    b = LibHistogram("h_seconds", "doc", buckets=buckets, registry=lib)
    rng = random.Random(0)
    values = [*buckets, *(x * (1 + 1e-12) for x in buckets), 0.0, -5.0, math.inf, -math.inf, math.nan, 1e300]
    values += [rng.uniform(-1, 70) for _ in range(500)] + [rng.choice(buckets) for _ in range(50)]
    for v in values:
        a.observe(v)
        b.observe(v)
    assert _text(ours) == _text(lib)


def test_a_histogram_without_a_nan_matches_sum_and_counts():
    ours, lib = CollectorRegistry(), CollectorRegistry()
    a = Histogram("r", "doc", buckets=_RATIO, registry=ours)
    b = LibHistogram("r", "doc", buckets=_RATIO, registry=lib)
    for v in (1.0, 1.0, 0.5, 0.97, 0.05, 0.0):
        a.observe(v)
        b.observe(v)
    assert _text(ours) == _text(lib)
    total = float(re.search(r"^r_sum (\S+)$", _text(ours), re.M).group(1))
    assert total == pytest.approx(3.52) and 'r_bucket{le="0.98"} 4.0' in _text(ours)


def test_labelled_histograms_and_counters_match_and_refuse_as_the_library():
    ours, lib = CollectorRegistry(), CollectorRegistry()
    ha = Histogram("lh", "doc", ["m"], buckets=(1, 2), registry=ours)
    hb = LibHistogram("lh", "doc", ["m"], buckets=(1, 2), registry=lib)
    ca = Counter("c", "doc", ["m"], registry=ours)
    cb = LibCounter("c", "doc", ["m"], registry=lib)
    for m, v in (("a", 0.5), ("b", 3.0), ("a", 2.0)):
        ha.labels(m=m).observe(v)
        hb.labels(m=m).observe(v)
        ca.labels(m=m).inc(v)
        cb.labels(m=m).inc(v)
    assert _text(ours) == _text(lib)
    with pytest.raises(ValueError):
        ha.observe(1.0)  # a labelled parent
    with pytest.raises(ValueError):
        ca.inc()
    with pytest.raises(ValueError):
        ca.labels(m="a").inc(-1)  # counters only go up


def test_the_app_metrics_are_the_lean_kinds():
    m = Metrics()
    assert isinstance(m.compression_ratio, Histogram) and isinstance(m.request_duration, Histogram)
    assert isinstance(m.tokens_original, Counter) and isinstance(m.loop_lane_batches, Counter)
    m.compression_ratio.observe(1.0)
    m.tokens_original.inc(22)
    text = m.exposition().decode()
    assert 'te_radix_mlp_compression_ratio_bucket{le="0.99"} 0.0' in text
    assert 'te_radix_mlp_compression_ratio_bucket{le="1.0"} 1.0' in text
    assert 'radixserve_tokens_total{kind="original"} 22.0' in text

"""Every Prometheus series of docs/api.md ("Metrics"), registered on one registry per app.

TEI's names (te_*) so existing dashboards carry over, plus the RadixMLP series. A registry per
app instance (never the process-global one) lets tests build several apps side by side. Serve
``Metrics.exposition()``, not ``generate_latest(registry)``: it types TEI's three request counters
as counters under their bare names, as TEI does.
"""
from __future__ import annotations

import threading
import time
from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client import Counter as _Counter
from prometheus_client import Histogram as _Histogram
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Latency buckets in seconds, 1 ms .. 60 s.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# N'/N per batch: 0.05 apart, finer near 1 where the threshold gate decides.
_RATIO = tuple(round(0.05 * i, 2) for i in range(1, 19)) + (0.92, 0.94, 0.96, 0.98, 0.99, 1.0)
_BATCH_SIZE = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_BATCH_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
# TEI's request counters: Prometheus counters named without the _total suffix.
TEI_COUNTERS = ("te_request_count", "te_request_success", "te_request_failure")


class Histogram(_Histogram):
    """prometheus_client's Histogram, observed under one lock into plain counts.

    The library's ``observe`` checks the metric's labels, compares the value with each upper bound
    in turn (24 steps for a compression ratio of 1.0) and takes a lock per value it adds to (the
    sum, then the bucket); several histograms are observed on every request's path, so this one
    finds the bucket by binary search and adds both under one lock. Its samples are the library's:
    the same series, values and exposition (``tests/test_metrics_lean.py``), a NaN counted in
    ``_sum`` and in no bucket. No exemplars, and no multiprocess mode (neither is used here).
    """

    def _metric_init(self) -> None:
        self._created = time.time()
        self._lock = threading.Lock()
        self._counts = [0] * len(self._upper_bounds)  # per bucket, not cumulative
        self._total = 0.0

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar is not None or (self._labelnames and not self._labelvalues):
            raise ValueError(f"{self._name}: observe a labelled child, without an exemplar")
        i = bisect_left(self._upper_bounds, amount)  # the first bound >= amount (the last is +Inf)
        with self._lock:
            self._total += amount
            if amount == amount:  # NaN compares below no bound
                self._counts[i] += 1

    def _child_samples(self) -> tuple[Sample, ...]:
        with self._lock:
            counts, total = list(self._counts), self._total
        samples, acc = [], 0.0
        for bound, count in zip(self._upper_bounds, counts):
            acc += count
            samples.append(Sample("_bucket", {"le": floatToGoString(bound)}, acc, None, None))
        samples.append(Sample("_count", {}, acc, None, None))
        if self._upper_bounds[0] >= 0:
            samples.append(Sample("_sum", {}, total, None, None))
        if prometheus_metrics._use_created:
            samples.append(Sample("_created", {}, self._created, None, None))
        return tuple(samples)


class Counter(_Counter):
    """prometheus_client's Counter without its per-call label check on the common path (the
    children of a labelled counter and an unlabelled one); a labelled parent, a negative amount or
    an exemplar take the library's own ``inc`` and its errors."""

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if exemplar is not None or amount < 0 or (self._labelnames and not self._labelvalues):
            super().inc(amount, exemplar)
            return
        self._value.inc(amount)


class Metrics:
    """Holds the metric objects; server updates the per-request ones, scheduler the per-batch ones."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        # NOTE: TEI (the Rust `metrics` exporter) exposes these three as counters under their bare
        # names, which TEI dashboards query (rate(te_request_count[...])). prometheus_client renders
        # any counter as NAME_total, so they are Counters here, reported by _BareCounters under the
        # bare names, and exposition() types them `counter`. promtool's lint still notes the missing
        # _total (and te_request_count's _count) suffix: TEI's names, kept on purpose.
        own = CollectorRegistry(auto_describe=False)  # the Counters' own, never scraped directly
        self.request_count = Counter("te_request_count", "Requests received", ["method"], registry=own)
        self.request_success = Counter("te_request_success", "Requests served", ["method"], registry=own)
        self.request_failure = Counter("te_request_failure", "Requests failed", ["err"], registry=own)
        r.register(_BareCounters((self.request_count, self.request_success, self.request_failure)))
        self.request_duration = Histogram("te_request_duration", "End-to-end request time (s)", buckets=_LATENCY, registry=r)
        self.tokenization_duration = Histogram(
            "te_request_tokenization_duration", "Tokenization time (s)", buckets=_LATENCY, registry=r
        )
        self.queue_duration = Histogram("te_request_queue_duration", "Time queued (s)", buckets=_LATENCY, registry=r)
        self.inference_duration = Histogram(
            "te_request_inference_duration", "Time in the model (s)", buckets=_LATENCY, registry=r
        )
        self.queue_size = Gauge("te_queue_size", "Entries waiting for a batch", registry=r)
        self.batch_next_size = Histogram("te_batch_next_size", "Items per batch", buckets=_BATCH_SIZE, registry=r)
        self.batch_next_tokens = Histogram("te_batch_next_tokens", "Tokens per batch", buckets=_BATCH_TOKENS, registry=r)
        self.compression_ratio = Histogram(
            "te_radix_mlp_compression_ratio", "Compact/original tokens (N'/N) per batch", buckets=_RATIO, registry=r
        )
        self.tokens_total = Counter("radixserve_tokens", "Tokens per kind", ["kind"], registry=r)
        # the two kinds' children, counted on every batch (labels() looks one up under a lock)
        self.tokens_original, self.tokens_compact = (self.tokens_total.labels(kind=k) for k in ("original", "compact"))
        self.batch_prep_duration = Histogram(
            "radixserve_batch_prep_duration", "CPU batch preparation time (s)", buckets=_LATENCY, registry=r
        )
        self.forward_duration = Histogram(
            "radixserve_forward_duration", "Model forward time per batch (s)", buckets=_LATENCY, registry=r
        )
        self.batching_policy = Gauge(
            "radixserve_batching_policy",
            "1 for the batch-formation policy in use (fifo or prefix), to split dashboards by policy",
            ["policy"],
            registry=r,
        )
        self.worker_idle_ratio = Gauge(
            "radixserve_worker_idle_ratio",
            "Share of wall time the model worker waited for a batch while the queue was not empty",
            registry=r,
        )
        self.oom_batches = Counter(
            "radixserve_oom_batches",
            "Batches failed because the device ran out of memory (each one's requests got a 500)",
            registry=r,
        )
        self.loop_lane_batches = Counter(
            "radixserve_loop_lane_batches",
            "Lone short requests run on the event loop rather than the pipeline's threads (scheduler/lane.py)",
            registry=r,
        )

        self.prefix_cache = _PrefixCacheCollector()  # zeros until a cache is watched
        r.register(self.prefix_cache)

    def batch_prepared(self, items: int, prepared: Any, prep_s: float) -> None:
        """One batch prepared (``prepared``: its ``n_tokens``, ``n_compact`` and ``ratio``): its
        size, its tokens, N'/N, the original and compact token counts, the time to prepare it."""
        self.batch_next_size.observe(items)
        self.batch_next_tokens.observe(prepared.n_tokens)
        self.compression_ratio.observe(prepared.ratio)
        self.tokens_original.inc(prepared.n_tokens)
        self.tokens_compact.inc(prepared.n_compact)
        self.batch_prep_duration.observe(prep_s)

    def exposition(self) -> bytes:
        """The /metrics body (Prometheus text format 0.0.4), TEI's request counters typed counter."""
        text = generate_latest(self.registry)
        for name in TEI_COUNTERS:
            text = text.replace(f"# TYPE {name} gauge\n".encode(), f"# TYPE {name} counter\n".encode(), 1)
        return text

    def watch_prefix_cache(self, cache) -> None:
        """Report this prefix cache's counters (its ``stats()``, read at scrape time); None: zeros."""
        self.prefix_cache.cache = cache


class _BareCounters:
    """TEI's counters under their bare names (no _total, no _created).

    Typed gauge here, because a plain ``generate_latest`` renders any counter family as NAME_total;
    ``Metrics.exposition`` retypes them. Read at scrape time from the Counter objects.
    """

    def __init__(self, counters) -> None:
        self.counters = counters

    def collect(self):
        for counter in self.counters:
            for family in counter.collect():
                bare = Metric(family.name, family.documentation + " (counter)", "gauge")
                for sample in family.samples:
                    if sample.name == family.name + "_total":
                        bare.add_sample(family.name, sample.labels, sample.value)
                yield bare


class _PrefixCacheCollector:
    """radixserve_prefix_cache_*: hit/miss tokens of batches that ran, bytes in use, evictions."""

    cache = None

    def collect(self):
        st = self.cache.stats() if self.cache is not None else {}
        tokens = CounterMetricFamily("radixserve_prefix_cache_tokens",
                                     "Tokens read from the prefix cache (hit) or computed (miss)", labels=["result"])
        tokens.add_metric(["hit"], st.get("hit_tokens", 0))
        tokens.add_metric(["miss"], st.get("miss_tokens", 0))
        yield tokens
        yield GaugeMetricFamily("radixserve_prefix_cache_bytes", "Prefix cache pool bytes in use",
                                value=st.get("bytes", 0))
        yield CounterMetricFamily("radixserve_prefix_cache_evictions", "Blocks evicted from the prefix cache",
                                  value=st.get("evictions", 0))

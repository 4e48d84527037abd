"""Every Prometheus series of docs/api.md ("Metrics"), registered on one registry per app.

TEI's names (te_*) so existing dashboards carry over, plus the RadixMLP series. A registry per
app instance (never the process-global one) lets tests build several apps side by side.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Latency buckets in seconds, 1 ms .. 60 s.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# N'/N per batch: 0.05 apart, finer near 1 where the threshold gate decides.
_RATIO = tuple(round(0.05 * i, 2) for i in range(1, 19)) + (0.92, 0.94, 0.96, 0.98, 0.99, 1.0)
_BATCH_SIZE = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_BATCH_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class Metrics:
    """Holds the metric objects; server updates the per-request ones, scheduler the per-batch ones."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        # NOTE: prometheus_client exposes every Counter as NAME_total, while TEI (Rust exporter)
        # exposes these three under their bare names; monotonic Gauges keep the exact TEI names so
        # TEI dashboards and alerts (rate(te_request_count[...])) work unchanged.
        self.request_count = Gauge("te_request_count", "Requests received (counter)", ["method"], registry=r)
        self.request_success = Gauge("te_request_success", "Requests served (counter)", ["method"], registry=r)
        self.request_failure = Gauge("te_request_failure", "Requests failed (counter)", ["err"], registry=r)
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

        self.prefix_cache = _PrefixCacheCollector()  # zeros until a cache is watched
        r.register(self.prefix_cache)

    def watch_prefix_cache(self, cache) -> None:
        """Report this prefix cache's counters (its ``stats()``, read at scrape time); None: zeros."""
        self.prefix_cache.cache = cache


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

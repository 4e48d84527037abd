"""One /metrics body from several processes' registries: every series summed over the processes.

Each process (the engine and every front end) has its own ``Metrics``; a front end counts
requests, tokenization and latencies, the engine counts batches, the queue and the prefix cache,
and a series a process does not drive stays at zero there. So the sum of every sample over the
processes is the server's figure: counters and histogram buckets add up, and so do the gauges
(each is set in one process only, or is per-process load such as nothing else). ``*_created``
samples take the earliest time. The families are what ``registry.collect()`` yields, pickled.
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from scheduler.metrics import TEI_COUNTERS


def merge(per_process: Iterable[Iterable[Metric]]) -> list[Metric]:
    """Families of the same name merged sample by sample (name and labels), in first-seen order."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    for families in per_process:
        for family in families:
            if family.name not in merged:
                merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            seen = values[family.name]
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in seen:
                    seen[key] = s.value
                elif s.name.endswith("_created"):
                    seen[key] = min(seen[key], s.value)
                else:
                    seen[key] += s.value
    for name, family in merged.items():
        for (sample, labels), value in values[name].items():
            family.add_sample(sample, dict(labels), value)
    return list(merged.values())


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def exposition(families: list[Metric]) -> bytes:
    """The Prometheus text of merged families, TEI's request counters typed counter (as
    ``Metrics.exposition`` renders one process's)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    text = generate_latest(registry)
    for name in TEI_COUNTERS:
        text = text.replace(f"# TYPE {name} gauge\n".encode(), f"# TYPE {name} counter\n".encode(), 1)
    return text

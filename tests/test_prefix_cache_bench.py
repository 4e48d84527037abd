"""bench_cache runs, and the computed rows it reports under the cache match an independent count.

The count: with a pool large enough to keep everything, one sequence per batch reads
min(common prefix with an earlier sequence, len - 1) tokens from the cache, maximised over the
earlier sequences (an earlier sequence left every token in the pool: its whole blocks and its
tail; rows of a block are read up to the last shared token); times are never asserted.
"""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks import bench_cache, cache_workloads
from models.runner import load_runner


def _lcp(a, b) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _expected_rows(seqs: list[list[int]]) -> list[int]:
    rows = []
    for k, s in enumerate(seqs):
        best = 0
        for e in seqs[:k]:
            best = max(best, min(_lcp(s, e), len(s) - 1))
        rows.append(len(s) - best)
    return rows


@pytest.mark.parametrize("workload,fixture", [("rerank-1", "tiny_reranker_dir"),
                                              ("chunks", "tiny_embedding_dir"),
                                              ("query", "tiny_embedding_dir")])
def test_rows_under_the_cache(workload, fixture, request):
    runner = load_runner(str(request.getfixturevalue(fixture)), device="cpu", dtype="float32")
    batches = cache_workloads.workload_batches(workload, runner, n=5, seed=3)
    assert len(batches) == 5 and all(len(b) == 1 for b in batches)
    results = {r.config: r for r in bench_cache.bench(runner, batches, workload=workload, warmup=1)}
    seqs = [b[0] for b in batches]
    want = _expected_rows(seqs)[1:]
    assert results["cache"].rows == pytest.approx(np.mean(want))
    assert results["radix-off"].rows == results["no-cache"].rows == pytest.approx(
        np.mean([len(s) for s in seqs[1:]]))
    assert results["cache"].rows < results["no-cache"].rows  # the shared template was served
    assert runner.prefix_cache is not None  # handed back after the no-cache turns

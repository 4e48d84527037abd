"""Scheduler end to end: the prefix-aware policy on a shuffled backlog, and the real tiny model.

The prefix test blocks the first batch's preparation until the whole backlog is queued, so every
later batch is formed from the same queue under either policy; N'/N per batch comes from the
fake runner's count of distinct prefixes (the trie's definition).
The real runner's ``prepare`` builds and gates the trie itself: checked against build_index.
"""
from __future__ import annotations

import asyncio
import random
import threading

import numpy as np

import pytest

from models import runner as runner_module
from models.options import MIN_SAVED_WORK
from models.trie import build_index, positions_from_cu_seqlens
from scheduler.forming import PrefixPolicy
from tests.test_scheduler import FakeRunner, expected, run_async


class GatedPrepRunner(FakeRunner):
    """FakeRunner whose first prepare waits until the test has queued everything."""

    def __init__(self):
        super().__init__(threshold=1.0)
        self.prep_gate = threading.Event()

    def prepare(self, input_ids, cu_seqlens, *, all_tokens=None, namespaces=None):
        self.prep_gate.wait(10)
        return super().prepare(input_ids, cu_seqlens, all_tokens=all_tokens)


def backlog(seed: int = 0) -> list[list[list[int]]]:
    """12 queries x 3 requests x 2 items: shared 10-token system prefix, 60-token query, 5-token passage."""
    rng = random.Random(seed)
    system = list(range(1, 11))
    reqs = []
    for q in range(12):
        query = [1000 + 60 * q + i for i in range(60)]
        for r in range(3):
            reqs.append([system + query + [5000 + 100 * q + 10 * r + j] * 5 for j in range(2)])
    rng.shuffle(reqs)
    return reqs


def mean_ratio_after_first(policy: str) -> tuple[float, list]:
    runner = GatedPrepRunner()
    reqs = backlog()

    async def go(sched):
        tasks = [asyncio.ensure_future(sched.submit(items)) for items in reqs]
        await asyncio.sleep(0.05)  # every submit has enqueued; the first batch's prep is parked
        runner.prep_gate.set()
        return await asyncio.gather(*tasks)

    # Budget: three requests (2 x 75 tokens each) per batch.
    # A static backlog drained at once: with the default skip budget (2) most requests age out
    # within a few batches and go oldest-first, so give the grouping room to show.
    _, results = run_async(runner, go, max_batch_tokens=450, policy=policy,
                               prefix_policy=PrefixPolicy(max_skips=8))
    for items, res in zip(reqs, results):
        for item, out in zip(items, res.outputs):
            assert np.array_equal(out, expected(item))
    later = runner.prepared[1:]
    assert later and all(p.used_index for p in later)
    return float(np.mean([p.n_compact / p.n_tokens for p in later])), later


def test_prefix_policy_improves_compression_over_fifo():
    fifo, _ = mean_ratio_after_first("fifo")
    prefix, batches = mean_ratio_after_first("prefix")
    # Grouping three requests of one query per batch shares query tokens that FIFO mostly mixes.
    assert prefix < fifo - 0.05, (prefix, fifo)
    assert all(p.n_tokens <= 450 for p in batches)


def test_scheduled_results_match_direct_runner(tiny_embedding_dir):
    import models

    runner = models.load_runner(str(tiny_embedding_dir), device="cpu", radix_mlp_threshold=1.0)
    reqs = [[[11, 12, 13, 14, 15], [11, 12, 13, 99]], [[11, 12, 7]], [[40, 41, 42, 43, 44, 45]]]

    async def go(sched):
        return await asyncio.gather(*(sched.submit(items) for items in reqs))

    _, results = run_async(runner, go, max_batch_tokens=64)
    for items, res in zip(reqs, results):
        for item, out in zip(items, res.outputs):
            cu = np.array([0, len(item)], np.int32)
            direct = runner.run(runner.prepare(np.array(item, np.int32), cu)).numpy()[0]
            np.testing.assert_allclose(out, direct, atol=1e-4, rtol=0)


@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.95, 1.0])
def test_runner_prepare_builds_and_gates_the_trie(tiny_embedding_dir, threshold, monkeypatch):
    import models

    # NOTE: no prefix cache: with one, a batch the gate keeps off the trie still runs in compact
    # mode (one node per token) so that it can read and write the pool.
    runner = models.load_runner(str(tiny_embedding_dir), device="cpu", radix_mlp_threshold=threshold,
                                prefix_cache_size=0)
    built = []
    monkeypatch.setattr(runner_module, "build_index", lambda *a, **k: built.append(build_index(*a, **k)) or built[-1])
    shared = [[5, 6, 7, 8, 9], [5, 6, 7, 1], [5, 6, 2, 3, 4, 4]]  # N'/N 12/15 = 0.8
    distinct = [[10, 11], [12, 13]]  # N'/N 1.0
    head = list(range(100, 300))
    long_shared = [head + [1, 2, 3, 4], head + [5, 6, 7, 8], head + [9, 10, 11, 12]]  # 400 rows saved
    for seqs in (shared, distinct, long_shared):
        ids = np.array([t for s in seqs for t in s], np.int32)
        cu = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int32)
        p = runner.prepare(ids, cu)
        assert p.n_tokens == len(ids)
        if threshold == 0.0:
            assert not built and not p.used_index and p.ratio == 1.0  # not even built
            assert p.n_compact == len(ids) and p.forward.mode == "off"
            continue
        index = build_index(ids, positions_from_cu_seqlens(cu), cu)
        assert built[-1].ratio == p.ratio == index.ratio
        saved_work = (len(ids) - len(index.compact_ids)) * runner.hidden_size  # too little for `shared`
        assert p.used_index == (threshold >= 1.0 or (index.ratio < threshold and saved_work >= MIN_SAVED_WORK))
        if seqs is long_shared:
            assert p.used_index
        assert p.n_compact == (len(index.compact_ids) if p.used_index else len(ids))
        assert p.forward.mode == ("compact" if p.used_index else "off")
        assert p.forward.num_rows == p.n_compact
    with pytest.raises(ValueError):
        models.load_runner(str(tiny_embedding_dir), device="cpu", radix_mlp_threshold=-0.1)


def test_policy_gauge_names_the_policy_in_use():
    from prometheus_client import generate_latest

    from scheduler.metrics import Metrics

    for policy in ("fifo", "prefix"):
        metrics = Metrics()

        async def go(sched):
            return await sched.submit([[1, 2, 3]])

        run_async(FakeRunner(), go, metrics=metrics, policy=policy)
        text = generate_latest(metrics.registry).decode()
        lines = [ln for ln in text.splitlines() if ln.startswith("radixserve_batching_policy{")]
        assert lines == [f'radixserve_batching_policy{{policy="{policy}"}} 1.0'], lines

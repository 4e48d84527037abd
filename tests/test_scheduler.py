"""Scheduler and pipeline: batching, ordering, cancellation, pipelining, failures, metrics.

A fake runner stands in for the model: ``run`` returns [sum(ids), len(ids)] per sequence (or the
sum alone, as a reranker's raw score), so every result is checkable against the submitted items;
its ``prepare`` reports N'/N from the definition (distinct prefixes), as the real runner's does.
"""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler import BatchFailed, Scheduler, WorkerDead
from scheduler.metrics import Metrics


class Boom(BaseException):
    """Escapes ``except Exception``: kills the worker thread."""


class FakePrepared:
    """What the scheduler reads from ``runner.prepare`` (scheduler.Prepared): N, N', N'/N and the
    tokens computed per item (all of them: no cache), plus the sequences and the all_tokens mask."""

    def __init__(self, seqs: list[list[int]], threshold: float, mask=None):
        self.seqs, self.mask = seqs, mask
        self.n_tokens = sum(map(len, seqs))
        self.computed_tokens = tuple(map(len, seqs))
        prefixes = {tuple(s[: k + 1]) for s in seqs for k in range(len(s))}
        self.ratio = len(prefixes) / self.n_tokens if self.n_tokens else 1.0
        self.used_index = threshold >= 1.0 or 0.0 < threshold and self.ratio < threshold
        self.n_compact = len(prefixes) if self.used_index else self.n_tokens


class FakeRunner:
    """A scheduler.ModelRunner: ``prepare`` on the prep thread, ``run`` on the worker."""

    def __init__(self, *, kind="embedding", run_s=0.0, prep_s=0.0, fail_token=None, die_token=None,
                 prep_fail_token=None, threshold=0.0):
        self.kind = kind
        self.device = "cpu"
        self.run_s, self.prep_s, self.threshold = run_s, prep_s, threshold
        self.fail_token, self.die_token, self.prep_fail_token = fail_token, die_token, prep_fail_token
        self.prepared: list[FakePrepared] = []
        self.prep_times: list[tuple[float, float]] = []  # (start, end) per batch prepared
        self.run_times: list[tuple[float, float]] = []  # (start, end) per batch run
        self.gate = threading.Event()
        self.gate.set()
        self.running = threading.Event()

    def prepare(self, input_ids, cu_seqlens, *, all_tokens=None, namespaces=None):
        assert input_ids.dtype == np.int32 and cu_seqlens.dtype == np.int32
        t0 = time.monotonic()
        time.sleep(self.prep_s)
        seqs = [input_ids[cu_seqlens[i] : cu_seqlens[i + 1]].tolist() for i in range(len(cu_seqlens) - 1)]
        if self.prep_fail_token in input_ids:
            raise ValueError("injected prepare failure")
        prepared = FakePrepared(seqs, self.threshold, all_tokens)
        self.prepared.append(prepared)
        self.prep_times.append((t0, time.monotonic()))
        return prepared

    def run(self, prepared):
        seqs = prepared.seqs
        self.running.set()
        self.gate.wait(10)
        t0 = time.monotonic()
        time.sleep(self.run_s)
        self.run_times.append((t0, time.monotonic()))
        tokens = {t for s in seqs for t in s}
        if self.die_token in tokens:
            raise Boom("worker killed")
        if self.fail_token in tokens:
            raise ValueError("injected failure")
        if self.kind == "reranker":
            return torch.tensor([float(sum(s)) for s in seqs])  # [B]
        pooled = torch.tensor([[float(sum(s)), float(len(s))] for s in seqs])  # [B, 2]
        if prepared.mask is None or not prepared.mask.any():
            return pooled
        # Flagged items answer one row per token, [L, 2]: [token, 1].
        return [torch.tensor([[float(t), 1.0] for t in s]) if m else p for s, m, p in zip(seqs, prepared.mask, pooled)]

    def batches(self) -> list[list[list[int]]]:
        return [p.seqs for p in self.prepared]


def expected(item: list[int], kind: str = "embedding"):
    return float(sum(item)) if kind == "reranker" else np.array([sum(item), len(item)], np.float32)


def req_items(r: int, lengths: list[int]) -> list[list[int]]:
    """Items whose tokens name their request (r) and position in it (j): token 100*r + j + 1."""
    return [[100 * r + j + 1] * n for j, n in enumerate(lengths)]


def owner(seq: list[int]) -> int:
    return (seq[0] - 1) // 100


def run_async(runner, coro_fn, **kw):
    """Start a scheduler, run ``coro_fn(sched)`` on a fresh loop, always stop it afterwards."""
    kw.setdefault("max_batch_tokens", 64)
    kw.setdefault("max_batch_requests", None)
    sched = Scheduler(runner, **kw)
    sched.start()

    async def main():
        try:
            return await asyncio.wait_for(coro_fn(sched), timeout=600)  # a hang only
        finally:
            if isinstance(runner, FakeRunner):
                runner.gate.set()
            await asyncio.to_thread(sched.stop, drain=False, timeout=5)

    return sched, asyncio.run(main())


async def until(pred, timeout=600.0):  # the condition is the event; the bound a hang
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("kind", ["embedding", "reranker"])
def test_results_map_back_to_items(kind):
    runner = FakeRunner(kind=kind)
    reqs = [req_items(r, [(r * 7 + j * 3) % 13 + 1 for j in range(r % 4 + 1)]) for r in range(12)]

    async def go(sched):
        return await asyncio.gather(*(sched.submit(items) for items in reqs))

    _, results = run_async(runner, go, max_batch_tokens=24)
    for items, res in zip(reqs, results):
        assert res.compute_tokens == sum(map(len, items))
        assert res.inference_time_s >= 0 and res.queue_time_s >= 0
        for item, out in zip(items, res.outputs):
            if kind == "reranker":
                assert isinstance(out, float) and out == expected(item, kind)
            else:
                assert out.dtype == np.float32 and np.array_equal(out, expected(item))


def test_budget_fifo_and_requests_kept_whole():
    runner = FakeRunner()
    runner.gate.clear()  # hold the first batch so the rest queue up behind it
    reqs = [req_items(r, [3 + (r * 3 + j) % 7 for j in range(1 + r % 3)]) for r in range(10)]

    async def go(sched):
        first = asyncio.ensure_future(sched.submit(req_items(99, [4])))
        await asyncio.to_thread(runner.running.wait, 5)
        tasks = [asyncio.ensure_future(sched.submit(items)) for items in reqs]
        await until(lambda: sched.queue_size + sum(map(len, runner.batches()[1:])) == sum(map(len, reqs)))
        runner.gate.set()
        await first
        return await asyncio.gather(*tasks)

    _, results = run_async(runner, go, max_batch_tokens=32, max_batch_requests=5)
    batches = runner.batches()[1:]
    for seqs in batches:
        assert sum(map(len, seqs)) <= 32 and len(seqs) <= 5
    order = [owner(s) for seqs in batches for s in seqs]
    assert order == sorted(order)  # FIFO across and within batches
    for r, items in enumerate(reqs):
        homes = {i for i, seqs in enumerate(batches) for s in seqs if owner(s) == r}
        assert len(homes) == 1, f"request {r} split over batches {homes}"
        assert [s for seqs in batches for s in seqs if owner(s) == r] == items
    for items, res in zip(reqs, results):
        assert all(np.array_equal(o, expected(i)) for i, o in zip(items, res.outputs))


def test_request_larger_than_budget_is_split_in_order():
    runner = FakeRunner(run_s=0.05)
    items = req_items(1, [30, 30, 30, 30, 20])

    async def go(sched):
        return await sched.submit(items)

    _, res = run_async(runner, go, max_batch_tokens=64)
    batches = runner.batches()
    assert len(batches) > 1 and all(sum(map(len, b)) <= 64 for b in batches)
    assert [s for b in batches for s in b] == items
    assert all(np.array_equal(o, expected(i)) for i, o in zip(items, res.outputs))
    forward = max(end - start for start, end in runner.run_times)  # the slowest of its batches
    # the max over its batches, not their sum (no wall-time margin: a busy machine stretches each)
    assert forward <= res.inference_time_s < sum(end - start for start, end in runner.run_times)


def test_cancelled_entries_are_dropped():
    runner = FakeRunner()
    runner.gate.clear()

    async def go(sched):
        tasks = [asyncio.ensure_future(sched.submit(req_items(r, [3, 2]))) for r in range(6)]
        # One batch running, one handed over (prep stays one batch ahead): the rest queue.
        await until(lambda: sched.queue_size == 4 * 2)
        tasks[4].cancel()
        await until(lambda: sched.queue_size == 3 * 2)
        runner.gate.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        return done

    _, done = run_async(runner, go, max_batch_requests=2)
    assert isinstance(done[4], asyncio.CancelledError)
    assert 4 not in {owner(s) for b in runner.batches() for s in b}
    for r in (0, 1, 2, 3, 5):
        assert [o.tolist() for o in done[r].outputs] == [expected(i).tolist() for i in req_items(r, [3, 2])]


def test_prep_of_next_batch_overlaps_forward():
    runner = FakeRunner(run_s=0.2, prep_s=0.02)

    async def go(sched):
        return await asyncio.gather(*(sched.submit(req_items(r, [8])) for r in range(4)))

    run_async(runner, go, max_batch_requests=1)
    assert len(runner.prep_times) == len(runner.run_times) == 4
    for (_, cur_end), (nxt_prep_start, nxt_prep_end), (nxt_start, _) in zip(
        runner.run_times, runner.prep_times[1:], runner.run_times[1:]
    ):
        assert nxt_prep_start < cur_end  # batch k+1 was being prepared while k ran
        assert nxt_prep_end < cur_end
        assert cur_end <= nxt_start


def test_batch_exception_fails_only_that_batch():
    runner = FakeRunner(fail_token=666, run_s=0.01)

    async def go(sched):
        good = asyncio.ensure_future(sched.submit(req_items(1, [5])))
        bad = asyncio.ensure_future(sched.submit([[666] * 3, [7]]))
        with pytest.raises(BatchFailed) as info:
            await bad
        assert "injected" not in str(info.value)  # clients get a generic message
        res = await good
        after = await sched.submit(req_items(2, [6, 2]))
        return res, after, sched.alive

    _, (res, after, alive) = run_async(runner, go, max_batch_requests=1)
    assert alive
    assert np.array_equal(res.outputs[0], expected(req_items(1, [5])[0]))
    assert [o.tolist() for o in after.outputs] == [expected(i).tolist() for i in req_items(2, [6, 2])]


def test_compression_reaches_the_metrics():
    runner = FakeRunner(threshold=0.95)
    shared = [[1, 2, 3, 4, 5, 6, 7, 8]] * 4  # N'/N 8/32: the gate lets the trie through
    distinct = [[10, 11], [12, 13], [14, 15]]  # N'/N 1.0: it does not

    async def go(sched):
        await sched.submit(shared)
        await sched.submit(distinct)

    metrics = Metrics()
    run_async(runner, go, metrics=metrics)
    assert [p.used_index for p in runner.prepared] == [True, False]
    assert [p.n_compact for p in runner.prepared] == [8, 6]
    assert sample(metrics, "radixserve_tokens_total", kind="compact") == 8 + 6
    assert sample(metrics, "radixserve_tokens_total", kind="original") == 38
    assert sample(metrics, "te_radix_mlp_compression_ratio_sum") == pytest.approx(0.25 + 1.0)


def sample(metrics, name, **labels):
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_metrics_move():
    runner = FakeRunner(run_s=0.01)
    metrics = Metrics()
    reqs = [req_items(r, [4, 3]) for r in range(5)]

    async def go(sched):
        return await asyncio.gather(*(sched.submit(items) for items in reqs))

    sched, _ = run_async(runner, go, max_batch_requests=2, metrics=metrics)
    n_batches = len(runner.prepared)
    assert sample(metrics, "te_batch_next_size_count") == n_batches
    assert sample(metrics, "te_batch_next_size_sum") == 10
    assert sample(metrics, "te_batch_next_tokens_sum") == 35
    assert sample(metrics, "te_radix_mlp_compression_ratio_count") == n_batches
    assert sample(metrics, "te_radix_mlp_compression_ratio_sum") == pytest.approx(n_batches)
    assert sample(metrics, "radixserve_batch_prep_duration_count") == n_batches
    assert sample(metrics, "radixserve_forward_duration_count") == n_batches
    assert sample(metrics, "radixserve_forward_duration_sum") >= 0.01 * n_batches
    assert sample(metrics, "te_queue_size") == 0
    assert 0.0 <= sample(metrics, "radixserve_worker_idle_ratio") <= 1.0


def test_worker_death_marks_dead_and_fails_everyone():
    runner = FakeRunner(die_token=13)
    runner.gate.clear()

    async def go(sched):
        doomed = asyncio.ensure_future(sched.submit([[13, 13]]))
        queued = [asyncio.ensure_future(sched.submit(req_items(r, [3]))) for r in range(1, 4)]
        await asyncio.to_thread(runner.running.wait, 5)
        await until(lambda: sched.queue_size == 2)  # doomed runs, request 1 is handed over
        runner.gate.set()
        outcomes = await asyncio.gather(doomed, *queued, return_exceptions=True)
        await until(lambda: not sched.alive)
        with pytest.raises(WorkerDead):
            await sched.submit([[1, 2]])
        return outcomes

    sched, outcomes = run_async(runner, go, max_batch_requests=1)
    assert not sched.alive
    assert all(isinstance(o, WorkerDead) for o in outcomes)


def test_stop_drains_queued_work():
    runner = FakeRunner(run_s=0.02)
    reqs = [req_items(r, [5, 4]) for r in range(6)]

    async def go(sched):
        tasks = [asyncio.ensure_future(sched.submit(items)) for items in reqs]
        await asyncio.sleep(0)  # let every submit enqueue
        assert sched.queue_size > 0
        await asyncio.to_thread(sched.stop, drain=True, timeout=10)
        assert not sched.alive
        with pytest.raises(WorkerDead):
            await sched.submit([[1]])
        return await asyncio.gather(*tasks)

    _, results = run_async(runner, go, max_batch_requests=2)
    for items, res in zip(reqs, results):
        assert [o.tolist() for o in res.outputs] == [expected(i).tolist() for i in items]


def test_stop_without_drain_fails_queued_work():
    runner = FakeRunner()
    runner.gate.clear()

    async def go(sched):
        tasks = [asyncio.ensure_future(sched.submit(req_items(r, [2]))) for r in range(5)]
        await until(lambda: sched.queue_size == 3)  # one running, one handed over
        stopping = asyncio.ensure_future(asyncio.to_thread(sched.stop, drain=False, timeout=10))
        await until(lambda: sched.queue_size == 0)
        runner.gate.set()
        await stopping
        return await asyncio.gather(*tasks, return_exceptions=True)

    _, outcomes = run_async(runner, go, max_batch_requests=1)
    assert [isinstance(o, WorkerDead) for o in outcomes] == [False, False, True, True, True]


def test_item_length_is_checked():
    async def go(sched):
        with pytest.raises(ValueError):
            await sched.submit([[1] * 65])
        with pytest.raises(ValueError):
            await sched.submit([[]])
        with pytest.raises(ValueError):
            await sched.submit([])

    run_async(FakeRunner(), go, max_batch_tokens=64)


def test_ragged_outputs_reach_each_item_whole():
    """A runner may return one output per item of any shape (e.g. per-token [L, E])."""

    class PerToken(FakeRunner):
        def run(self, prepared):
            return [torch.tensor([[float(t), 1.0] for t in s]) for s in prepared.seqs]  # [L, 2] each

    items = [[3, 4, 5], [7], [8, 9]]

    async def go(sched):
        return await sched.submit(items)

    _, res = run_async(PerToken(), go)
    for item, out in zip(items, res.outputs):
        assert out.dtype == np.float32 and out.shape == (len(item), 2)
        assert out[:, 0].tolist() == item



def test_the_pipeline_is_alive_from_start_until_a_thread_ends():
    """``Pipeline.alive`` reads flags (no thread's lock): false before ``start``, true while its
    threads run, false once one of them has returned, as ``Thread.is_alive`` would say."""
    sched = Scheduler(FakeRunner(), max_batch_tokens=64, max_batch_requests=None)
    pipeline = sched._pipeline
    assert not pipeline.alive and not sched.alive
    sched.start()
    threads = [pipeline._prep, pipeline._worker, pipeline._settler.thread]
    assert pipeline.alive and sched.alive and all(t.is_alive() for t in threads)
    sched.stop(drain=True, timeout=30)
    assert not pipeline.alive and not sched.alive
    assert not any(t.is_alive() for t in threads)

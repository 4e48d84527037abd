"""The loop lane (scheduler/lane.py): a lone short request at an idle CPU pipeline runs on the loop.

Each test drives a real Scheduler with ``lane=True`` over the fake runner of test_scheduler.py,
noting the thread each batch's ``run`` ran on, and checks where a batch ran, what it held, and
that every request got its own answer (or its own error); the last one serves the tiny
checkpoint with the lane open and closed.
"""
from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import pytest

import scheduler.lane
from scheduler import BatchFailed, Scheduler
from scheduler.lane import BUDGET_S, LANE_TOKENS, Lane
from scheduler.metrics import Metrics
from tests.serving import serve
from tests.test_scheduler import expected, req_items, run_async
from tests.test_scheduler_handover import ThreadRecordingRunner as ThreadRunner


@pytest.fixture
def any_cost(monkeypatch):
    """A budget no batch of these tests exceeds, however busy the machine: where a batch runs
    then depends on the pipeline's state alone."""
    monkeypatch.setattr(scheduler.lane, "BUDGET_S", 3600.0)


def lane_run(runner, coro_fn, **kw):
    return run_async(runner, coro_fn, lane=True, **kw)


def check(out, items):
    for got, item in zip(out.outputs, items):
        np.testing.assert_array_equal(got, expected(item))


def test_a_lone_short_request_runs_on_the_loop_once_its_cost_is_known(any_cost):
    runner = ThreadRunner()
    metrics = Metrics()

    async def go(sched):
        results = []
        for r in range(4):
            items = req_items(r, [3])
            results.append((await sched.submit(items), items))
        return results

    _, results = lane_run(runner, go, metrics=metrics)
    for out, items in results:
        check(out, items)
    # The first lone batch runs on the prep thread (its cost unknown), the others on the loop.
    assert runner.threads == ["rs-prep", "MainThread", "MainThread", "MainThread"]
    assert "radixserve_loop_lane_batches_total 3.0" in metrics.exposition().decode().splitlines()


def test_requests_that_arrive_together_are_batched_in_arrival_order(any_cost):
    runner = ThreadRunner()

    async def go(sched):
        await sched.submit(req_items(9, [2]))  # the lane's cost is known from here on
        reqs = [req_items(r, [2]) for r in range(4)]
        outs = await asyncio.gather(*(sched.submit(items) for items in reqs))
        return reqs, outs

    _, (reqs, outs) = lane_run(runner, go)
    for out, items in zip(outs, reqs):
        check(out, items)
    # The first of the four claimed the lane; the second queued it ahead of itself, so all four
    # reached the prep thread together, in the order they were submitted.
    assert "MainThread" not in runner.threads[1:]
    later = [s for b in runner.batches()[1:] for s in b]
    assert later == [item for items in reqs for item in items]


def test_a_slow_batch_never_blocks_the_loop():
    runner = ThreadRunner(run_s=BUDGET_S * 2)  # its wall time is over the budget, however fast the machine

    async def go(sched):
        for r in range(3):
            await sched.submit(req_items(r, [2]))

    lane_run(runner, go)
    assert runner.threads == ["rs-prep"] * 3


def test_a_long_input_never_runs_on_the_loop(any_cost):
    runner = ThreadRunner()

    async def go(sched):
        await sched.submit(req_items(1, [2]))
        return await sched.submit(req_items(2, [LANE_TOKENS + 1]))

    _, out = lane_run(runner, go)
    check(out, req_items(2, [LANE_TOKENS + 1]))
    assert runner.threads == ["rs-prep", "rs-prep"]


def test_without_the_lane_or_off_the_cpu_nothing_runs_on_the_loop(any_cost):
    for runner, kw in ((ThreadRunner(), {}), (ThreadRunner(), {"lane": True, "inline": False})):
        async def go(sched):
            for r in range(3):
                await sched.submit(req_items(r, [2]))

        run_async(runner, go, **kw)
        assert "MainThread" not in runner.threads


def test_a_failure_in_the_lane_fails_only_its_request(any_cost):
    runner = ThreadRunner(fail_token=201)

    async def go(sched):
        await sched.submit(req_items(1, [2]))
        with pytest.raises(BatchFailed):
            await sched.submit(req_items(2, [2]))  # tokens 201: the runner raises
        return await sched.submit(req_items(3, [2]))

    sched, out = lane_run(runner, go)
    check(out, req_items(3, [2]))
    assert runner.threads == ["rs-prep", "MainThread", "MainThread"]


class FaultRunner(ThreadRunner):
    """Raises a device fault (a poisoned CUDA context, as torch words it) on token 201."""

    def run(self, prepared):
        if any(201 in s for s in prepared.seqs):
            self.threads.append(threading.current_thread().name)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().run(prepared)


def test_a_device_fault_in_the_lane_takes_the_pipeline_down_once(any_cost):
    from scheduler import WorkerDead
    from scheduler.faults import DeviceFault

    runner, deaths = FaultRunner(), []

    async def go(sched):
        await sched.submit(req_items(1, [2]))
        with pytest.raises(WorkerDead):
            await sched.submit(req_items(2, [2]))
        assert not sched.alive
        with pytest.raises(WorkerDead):
            await sched.submit(req_items(3, [2]))

    lane_run(runner, go, on_death=deaths.append)
    assert runner.threads == ["rs-prep", "MainThread"]
    assert len(deaths) == 1 and isinstance(deaths[0], DeviceFault)


def test_a_claim_cancelled_before_it_runs_never_reaches_the_runner(any_cost):
    runner = ThreadRunner()

    async def go(sched):
        await sched.submit(req_items(1, [2]))
        ticket = sched.enqueue(req_items(2, [2]))  # claimed; its callback queued behind this task
        sched.cancel(ticket)  # what a submit's task does when its client leaves
        out = await sched.submit(req_items(3, [2]))
        assert ticket.future.cancelled()
        return out

    _, out = lane_run(runner, go)
    check(out, req_items(3, [2]))
    assert [(s[0] - 1) // 100 for b in runner.batches() for s in b] == [1, 3]


def test_a_claim_pending_at_a_draining_stop_is_answered(any_cost):
    runner = ThreadRunner()
    sched = Scheduler(runner, max_batch_tokens=64, lane=True)
    sched.start()

    async def go():
        await sched.submit(req_items(1, [2]))
        ticket = sched.enqueue(req_items(2, [2]))  # claimed; its callback has not run
        sched.stop(drain=True, timeout=600)  # on the loop: the callback runs only after it
        return await ticket.future

    out = asyncio.run(go())
    check(out, req_items(2, [2]))
    assert runner.threads == ["rs-prep", "rs-prep"]  # drained by the pipeline


def test_the_cost_estimate_follows_lone_batches():
    lane = Lane()
    assert not lane.admits(4)  # unknown
    lane.observe(4, BUDGET_S / 2)
    assert lane.admits(4) and not lane.admits(LANE_TOKENS + 1)
    lane.observe(LANE_TOKENS + 1, 1.0)  # a longer batch says nothing of short ones
    assert lane.admits(4)
    lane.observe(4, 10.0)  # one batch held up: the lane stays open
    assert lane.admits(4)
    for _ in range(8):  # costs that stay over the budget close it
        lane.observe(4, BUDGET_S * 4)
    assert not lane.admits(4)
    for _ in range(8):  # ... and cheap ones open it again
        lane.observe(4, BUDGET_S / 4)
    assert lane.admits(4)


def lane_batches(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=600).text.splitlines():
        if line.startswith("radixserve_loop_lane_batches_total "):
            return float(line.split()[1])
    raise AssertionError("no radixserve_loop_lane_batches_total on /metrics")


def test_a_server_answers_a_lone_query_in_the_lane_as_on_its_threads(tiny_embedding_dir, monkeypatch):
    """The real server and checkpoint: lone queries served in the lane and with the lane closed
    get the same vectors (to float rounding: the measured lone path may pick another thread count)."""
    queries = [f"Query: what is the capital of country number {i}" for i in range(6)]

    def serve_all(budget_s: float) -> tuple[list, float]:
        monkeypatch.setattr(scheduler.lane, "BUDGET_S", budget_s)
        srv = serve(tiny_embedding_dir)
        try:
            vectors = [httpx.post(srv.url + "/v1/embeddings", json={"input": q}, timeout=600).json()
                       ["data"][0]["embedding"] for q in queries]
            return vectors, lane_batches(srv.url)
        finally:
            srv.stop()

    in_lane, ran_in_lane = serve_all(3600.0)
    on_threads, ran_closed = serve_all(1e-9)  # no batch costs that little
    assert ran_in_lane >= len(queries) - 1 and ran_closed == 0  # the first ran before the cost was known
    np.testing.assert_allclose(np.array(in_lane), np.array(on_threads), rtol=1e-5, atol=1e-6)

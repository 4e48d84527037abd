"""Where a batch runs and how it is settled: the hop-count rules of scheduler/pipeline.py.

- a lone batch at an idle CPU pipeline runs on the prep thread (no hand-over); with others
  waiting, batches go to the worker, which overlaps with the next prepare;
- every batch the worker runs is delivered on the settling thread (its outputs split and its
  entries resolved there, never on the worker); a lone batch run on the prep thread is delivered
  there;
- a runner returning a ``PendingOutput`` (what models/streams.py's ``HostCopy`` is on CUDA) is
  settled on its own thread: the worker launches the next batch before the previous output is on
  the host, with at most IN_FLIGHT batches unsettled; a failed copy fails that batch only;
- a batch's outcomes reach the event loop in one ``call_soon_threadsafe``, not one per item.
The stand-ins read only what the CUDA code reads: an event to wait for and a finisher.
"""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from scheduler import BatchFailed, Scheduler
from scheduler.pipeline import IN_FLIGHT
from tests.test_scheduler import FakeRunner, expected, req_items, run_async


class ThreadRecordingRunner(FakeRunner):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.threads: list[str] = []

    def run(self, prepared):
        self.threads.append(threading.current_thread().name)
        return super().run(prepared)


def test_a_lone_request_runs_on_the_prep_thread_and_a_backlog_on_the_worker():
    runner = ThreadRecordingRunner(run_s=0.05)

    async def go(sched):
        lone = await sched.submit([[1, 2, 3]])
        burst = await asyncio.gather(*(sched.submit(req_items(r, [2])) for r in range(1, 6)))
        return lone, burst

    _, (lone, burst) = run_async(runner, go, max_batch_requests=1)
    assert np.array_equal(lone.outputs[0], expected([1, 2, 3]))
    assert [b.outputs[0].tolist() for b in burst] == [expected(req_items(r, [2])[0]).tolist() for r in range(1, 6)]
    assert runner.threads[0] == "rs-prep"
    assert "rs-worker" in runner.threads[1:]  # a backlog goes to the worker


def test_without_inline_every_batch_runs_on_the_worker():
    runner = ThreadRecordingRunner()

    async def go(sched):
        for r in range(3):
            await sched.submit(req_items(r + 1, [2]))

    run_async(runner, go, inline=False)
    assert runner.threads == ["rs-worker"] * 3


class Output:
    """A host output that records the thread that splits it into the entries' outputs."""

    def __init__(self, value, seen: list[str]):
        self.value, self.seen = value, seen

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):  # every way to the host ends here (scheduler/packing.py, ``_host``)
        self.seen.append(threading.current_thread().name)
        return np.asarray(self.value)


class DeliveryRecordingRunner(ThreadRecordingRunner):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.split_on: list[str] = []

    def run(self, prepared):
        return Output(super().run(prepared), self.split_on)


@pytest.mark.parametrize("inline", [False, True])
def test_the_worker_runs_batches_and_the_settling_thread_delivers_them(inline):
    runner = DeliveryRecordingRunner()

    async def go(sched):
        return [await sched.submit(req_items(r + 1, [2])) for r in range(3)]

    _, results = run_async(runner, go, inline=inline)
    assert [r.outputs[0].tolist() for r in results] == [expected(req_items(r + 1, [2])[0]).tolist() for r in range(3)]
    # one request at a time: inline, each runs and is delivered on the prep thread
    want_run, want_split = ("rs-prep", "rs-prep") if inline else ("rs-worker", "rs-settle")
    assert runner.threads == [want_run] * 3 and runner.split_on == [want_split] * 3


class Pending:
    """A copy to the host still under way: ``result()`` waits for its event (HostCopy's shape)."""

    def __init__(self, out, done: threading.Event, fail: bool = False):
        self.out, self.done, self.fail = out, done, fail

    def result(self):
        assert self.done.wait(10)
        if self.fail:
            raise RuntimeError("injected copy failure")
        return self.out


class AsyncCopyRunner(FakeRunner):
    """``run`` returns at once with a Pending; the test releases each batch's copy."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.copies: list[threading.Event] = []
        self.launched = threading.Semaphore(0)
        self.fail_copy_token: int | None = None
        self.settled_on: list[str] = []

    def run(self, prepared):
        out = super().run(prepared)
        done = threading.Event()
        self.copies.append(done)
        self.launched.release()
        runner = self

        class Recording(Pending):
            def result(self):
                runner.settled_on.append(threading.current_thread().name)
                return super().result()

        fail = self.fail_copy_token is not None and any(self.fail_copy_token in s for s in prepared.seqs)
        return Recording(out, done, fail)


def test_pending_outputs_settle_on_their_own_thread_and_the_worker_runs_ahead():
    runner = AsyncCopyRunner()

    async def go(sched):
        tasks = [asyncio.ensure_future(sched.submit(req_items(r, [2]))) for r in range(1, 5)]
        # IN_FLIGHT batches launch although no copy has finished; the next one waits for a place.
        for _ in range(IN_FLIGHT):
            assert await asyncio.to_thread(runner.launched.acquire, True, 5)
        assert not await asyncio.to_thread(runner.launched.acquire, True, 0.3)
        assert not any(t.done() for t in tasks)
        for i in range(4):
            while len(runner.copies) <= i:
                await asyncio.sleep(0.01)
            runner.copies[i].set()
        return await asyncio.gather(*tasks)

    _, results = run_async(runner, go, max_batch_requests=1, inline=False)
    assert [r.outputs[0].tolist() for r in results] == [expected(req_items(r, [2])[0]).tolist() for r in range(1, 5)]
    assert set(runner.settled_on) == {"rs-settle"}


def test_a_failed_copy_fails_only_its_batch():
    runner = AsyncCopyRunner()
    runner.fail_copy_token = 13

    async def go(sched):
        threading.Thread(target=lambda: [_release_all(runner) for _ in range(50)], daemon=True).start()
        bad = asyncio.ensure_future(sched.submit([[13, 13]]))
        good = asyncio.ensure_future(sched.submit([[1, 2]]))
        out = await asyncio.gather(bad, good, return_exceptions=True)
        return out, sched.alive

    _, ((bad, good), alive) = run_async(runner, go, max_batch_requests=1, inline=False)
    assert isinstance(bad, BatchFailed) and alive
    assert np.array_equal(good.outputs[0], expected([1, 2]))


def _release_all(runner: AsyncCopyRunner) -> None:
    for e in list(runner.copies):
        e.set()
    time.sleep(0.02)


def test_a_batch_reaches_the_loop_in_one_callback(monkeypatch):
    runner = FakeRunner()
    calls: list[int] = []

    async def go(sched):
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            if getattr(cb, "__name__", "") == "_settle":  # the scheduler's, not the executor's
                calls.append(len(args[0]))
            return real(cb, *args, **kw)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
        return await sched.submit([[i + 1] for i in range(40)])

    _, res = run_async(runner, go, max_batch_tokens=64)
    assert [o.tolist() for o in res.outputs] == [expected([i + 1]).tolist() for i in range(40)]
    assert calls == [40]  # one callback carried all 40 outcomes


@pytest.mark.gpu
def test_cuda_outputs_come_back_through_a_host_copy_equal_to_a_waiting_run(tiny_embedding_dir):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import models
    from models import streams
    # no prefix cache: the second run would read the first's K/V and compute in other shapes
    runner = models.load_runner(str(tiny_embedding_dir), device="cuda", dtype="float32",
                                prefix_cache_size=0)
    ids = np.arange(1, 41, dtype=np.int32)
    cu = np.array([0, 16, 32, 40], np.int32)
    waited = runner.run(runner.prepare(ids, cu))
    runner.defer_copies = True
    pending = runner.run(runner.prepare(ids, cu))
    assert isinstance(pending, streams.HostCopy) and pending.hosts[0].is_pinned()
    assert torch.equal(pending.result(), waited)

    async def go(sched):
        return await asyncio.gather(*(sched.submit([ids[:16].tolist(), ids[16:32].tolist()]) for _ in range(8)))

    sched = Scheduler(runner, max_batch_tokens=64, max_batch_requests=2)
    sched.start()
    try:
        results = asyncio.run(go(sched))
    finally:
        sched.stop()
    for r in results:
        np.testing.assert_allclose(np.stack(r.outputs), waited[:2].numpy(), atol=1e-5)

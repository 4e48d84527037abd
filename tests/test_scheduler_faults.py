"""Faults at every step of a batch's life, and a dead thread; the event loop never waits on forming.

Each injected ``Exception`` (form, index, prepare, hand over, run, deliver) must fail only the batch
it hit: those entries get a generic BatchFailed, the log names the stage, the batch and the
request ids, the next batch is served and the scheduler stays alive. A ``BaseException`` kills a
thread: ``on_death`` is called once and everything pending gets WorkerDead.
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import numpy as np
import pytest

from scheduler import BatchFailed, Scheduler, WorkerDead
from tests.test_scheduler import Boom, FakeRunner, expected, req_items, run_async, until

POISON = 666


def poisoned(waiting) -> bool:
    return any(POISON in e.input_ids for e in waiting)


class BadOutputs(FakeRunner):
    """Returns one output too few for a batch holding the poison token (fails in deliver)."""

    def run(self, prepared):
        out = super().run(prepared)
        return out[:-1] if any(POISON in s for s in prepared.seqs) else out


def _inject(stage: str, sched: Scheduler, monkeypatch) -> None:
    pipeline = sched._pipeline
    if stage == "form":
        real = pipeline.former

        def former(waiting, now):
            if poisoned(waiting[:1]):  # the poisoned request is the oldest one
                raise ValueError("injected form failure")
            return real(waiting, now)

        monkeypatch.setattr(pipeline, "former", former)
    elif stage == "hand over":
        real_put = pipeline._handoff.put

        def put(item, *a, **kw):
            if hasattr(item, "entries") and poisoned(item.entries):
                raise ValueError("injected hand-over failure")
            return real_put(item, *a, **kw)

        monkeypatch.setattr(pipeline._handoff, "put", put)


def _runner(stage: str) -> FakeRunner:
    if stage == "prepare":
        return FakeRunner(prep_fail_token=POISON)
    if stage == "run":
        return FakeRunner(fail_token=POISON)
    if stage == "deliver":
        return BadOutputs()
    return FakeRunner()


@pytest.mark.parametrize("stage", ["form", "prepare", "hand over", "run", "deliver"])
def test_a_fault_fails_only_its_batch(stage, monkeypatch, caplog):
    runner = _runner(stage)
    caplog.set_level(logging.ERROR, logger="scheduler.pipeline")

    async def go(sched):
        _inject(stage, sched, monkeypatch)
        # Two items per batch: the first request, the poisoned one and the good one each fill one.
        first = asyncio.ensure_future(sched.submit(req_items(1, [4])))
        bad = asyncio.ensure_future(sched.submit([[POISON] * 3, [7]], request_id="badc0ffee"))
        good = asyncio.ensure_future(sched.submit(req_items(2, [5, 3]), request_id="900d"))
        with pytest.raises(BatchFailed) as info:
            await bad
        assert str(info.value) == "the model failed on this batch"  # nothing internal leaks
        ok = await asyncio.gather(first, good)
        after = await sched.submit(req_items(3, [2]))
        return ok, after, sched.alive

    _, (ok, after, alive) = run_async(runner, go, max_batch_requests=2)
    assert alive
    assert [o.tolist() for o in ok[1].outputs] == [expected(i).tolist() for i in req_items(2, [5, 3])]
    assert np.array_equal(after.outputs[0], expected(req_items(3, [2])[0]))
    lines = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 1  # one batch failed, one line for it
    msg = lines[0].getMessage()
    # the second batch (the first request ran alone), the stage, the exception and the request id
    assert re.fullmatch(rf"batch 2 failed at {stage}: \w+: .+; requests badc0ffee", msg), msg
    assert lines[0].exc_info is not None  # with the traceback


def test_index_fault_in_the_real_runner_fails_only_its_batch(tiny_embedding_dir, monkeypatch, caplog):
    import models
    from models import runner as runner_module
    runner = models.load_runner(str(tiny_embedding_dir), device="cpu", radix_mlp_threshold=1.0)
    real = runner_module.build_index

    def build_index(input_ids, positions, cu_seqlens, **kw):
        if POISON in input_ids:
            raise ValueError("injected index failure")
        return real(input_ids, positions, cu_seqlens, **kw)

    monkeypatch.setattr(runner_module, "build_index", build_index)
    caplog.set_level(logging.ERROR, logger="scheduler.pipeline")

    async def go(sched):
        with pytest.raises(BatchFailed):
            await sched.submit([[POISON, 1, 2]])
        return await sched.submit([[1, 2, 3], [1, 2, 4]]), sched.alive

    _, (res, alive) = run_async(runner, go, max_batch_tokens=64)
    assert alive and len(res.outputs) == 2 and res.outputs[0].shape == (runner.hidden_size,)
    (line,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert line.getMessage().startswith("batch 1 failed at prepare: ValueError: injected index failure")
    direct = runner.run(runner.prepare(np.array([1, 2, 3, 1, 2, 4], np.int32), np.array([0, 3, 6], np.int32)))
    np.testing.assert_allclose(np.stack(res.outputs), direct.numpy(), atol=1e-5)


async def _kill_mid_batch(sched: Scheduler, runner: FakeRunner, doomed_items, **kw) -> list:
    """One batch held running, then ``doomed_items`` (the fatal ones) and two more requests queued
    behind it; the batch is released, the pipeline dies, and a later submit gets WorkerDead.
    Returns the four outcomes in that order (running, doomed, queued...)."""
    running = asyncio.ensure_future(sched.submit(req_items(1, [3])))
    await asyncio.to_thread(runner.running.wait, 5)
    doomed = asyncio.ensure_future(sched.submit(doomed_items, **kw))
    queued = [asyncio.ensure_future(sched.submit(req_items(r, [3]))) for r in (2, 3)]
    await asyncio.sleep(0.05)
    runner.gate.set()
    outcomes = await asyncio.gather(running, doomed, *queued, return_exceptions=True)
    await until(lambda: not sched.alive)
    with pytest.raises(WorkerDead):
        await sched.submit([[1, 2]])
    return outcomes


@pytest.mark.parametrize("where", ["worker", "prep"])
def test_a_dead_thread_calls_on_death_once_and_fails_everything(where, monkeypatch):
    runner = FakeRunner(die_token=13 if where == "worker" else None)
    runner.gate.clear()
    deaths: list[BaseException] = []

    async def go(sched):
        if where == "prep":
            real = sched._pipeline.former

            def former(waiting, now):
                if any(13 in e.input_ids for e in waiting):
                    raise Boom("prep thread killed")
                return real(waiting, now)

            monkeypatch.setattr(sched._pipeline, "former", former)
        return await _kill_mid_batch(sched, runner, [[13, 13]])

    # inline=False: the first batch must run on the worker while the prep thread dies.
    sched, outcomes = run_async(runner, go, max_batch_requests=1, on_death=deaths.append, inline=False)
    assert len(deaths) == 1 and isinstance(deaths[0], Boom)
    assert not sched.alive
    if where == "worker":  # the batch before ran; the one that killed it and all behind it failed
        assert not isinstance(outcomes[0], BaseException)
        assert all(isinstance(o, WorkerDead) for o in outcomes[1:])
    else:  # the prep thread died while the first batch ran: everything pending failed
        assert all(isinstance(o, WorkerDead) for o in outcomes)
    assert all(str(o) == "the model worker is not running" for o in outcomes if isinstance(o, WorkerDead))


def test_submit_is_not_blocked_by_a_slow_former(monkeypatch):
    runner = FakeRunner()
    forming = threading.Event()

    async def go(sched):
        real = sched._pipeline.former

        def slow(waiting, now):
            if any(e.input_ids[0] == 501 for e in waiting):
                forming.set()
                time.sleep(0.5)
            return real(waiting, now)

        monkeypatch.setattr(sched._pipeline, "former", slow)
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(sched.submit([[501, 2]]))
        await asyncio.to_thread(forming.wait, 5)
        t0 = loop.time()
        second = asyncio.ensure_future(sched.submit([[7, 8]]))
        await asyncio.sleep(0)  # the submit runs up to its first await: the push under the lock
        gone = asyncio.ensure_future(sched.submit([[9, 9]]))
        await asyncio.sleep(0)
        gone.cancel()  # a cancel takes the same lock
        await asyncio.sleep(0)
        blocked = loop.time() - t0
        assert forming.is_set() and blocked < 0.1, blocked
        return await asyncio.gather(first, second)

    run_async(runner, go)


def test_entries_cancelled_while_forming_are_dropped(monkeypatch):
    runner = FakeRunner()
    queued, forming, release = threading.Event(), threading.Event(), threading.Event()
    snapshots = []

    async def go(sched):
        real, real_snapshot = sched._pipeline.former, sched._waiting.snapshot

        def snapshot(timeout=None):
            queued.wait(5)  # the prep thread looks only once both requests wait
            return real_snapshot(timeout)

        def held(waiting, now):
            snapshots.append(len(waiting))
            if not release.is_set():
                forming.set()
                release.wait(5)
            return real(waiting, now)

        monkeypatch.setattr(sched._waiting, "snapshot", snapshot)
        monkeypatch.setattr(sched._pipeline, "former", held)
        keep = asyncio.ensure_future(sched.submit(req_items(1, [3])))
        drop = asyncio.ensure_future(sched.submit(req_items(2, [3])))
        await until(lambda: sched.queue_size == 2)
        queued.set()
        await asyncio.to_thread(forming.wait, 5)
        drop.cancel()
        await asyncio.sleep(0.01)
        release.set()
        return await keep

    run_async(runner, go)
    assert snapshots[0] == 2  # the former chose from both requests
    assert runner.batches() == [req_items(1, [3])]  # the cancelled request never reached prepare


class CudaFaultRunner(FakeRunner):
    """Raises, from inside ``run``, what torch raises for a real CUDA failure (tests/fault_server.py)."""

    def __init__(self, kind: str, **kw):
        super().__init__(**kw)
        self.fault_kind = kind

    def run(self, prepared):
        if any(POISON in s for s in prepared.seqs):
            from tests.fault_server import cuda_error

            raise cuda_error(self.fault_kind)
        return super().run(prepared)


@pytest.mark.parametrize("kind", ["illegal", "assert"])
def test_a_cuda_fault_ends_the_pipeline_and_fails_everything_pending(kind, caplog):
    from scheduler.faults import DeviceFault
    from scheduler.metrics import Metrics

    runner = CudaFaultRunner(kind)
    runner.gate.clear()
    deaths: list[BaseException] = []
    metrics = Metrics()

    async def go(sched):
        return await _kill_mid_batch(sched, runner, [[POISON, 1]], request_id="f00d")

    caplog.set_level(logging.ERROR, logger="scheduler.pipeline")
    sched, outcomes = run_async(runner, go, max_batch_requests=1, on_death=deaths.append, metrics=metrics)
    assert not isinstance(outcomes[0], BaseException)  # the batch before the fault ran
    # the faulted batch and every one behind it: 503, never a 500 that a retry would hit again
    assert all(isinstance(o, WorkerDead) for o in outcomes[1:]), outcomes
    assert len(deaths) == 1 and isinstance(deaths[0], DeviceFault)
    assert "CUDA error" in str(deaths[0].__cause__)
    (line,) = [r for r in caplog.records if r.levelno == logging.CRITICAL and "device fault" in r.getMessage()]
    assert "batch 2 hit a device fault at run" in line.getMessage() and "f00d" in line.getMessage()
    assert metrics.oom_batches._value.get() == 0


def test_out_of_memory_fails_only_its_batch_and_is_counted(caplog, monkeypatch):
    import torch

    from scheduler.metrics import Metrics

    # Stand-ins for the two calls scheduler/faults.py makes on a CUDA process.
    released: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(threading.current_thread().name))
    runner = CudaFaultRunner("oom")
    metrics = Metrics()

    async def go(sched):
        with pytest.raises(BatchFailed):
            await sched.submit([[POISON, 1]])
        with pytest.raises(BatchFailed):
            await sched.submit([[POISON, 2]])
        return await sched.submit(req_items(1, [3])), sched.alive

    caplog.set_level(logging.ERROR, logger="scheduler.pipeline")
    # inline=False: forwards on the worker, as on CUDA (the runner stands in for a CUDA one)
    _, (after, alive) = run_async(runner, go, max_batch_requests=1, metrics=metrics, inline=False)
    assert alive and np.array_equal(after.outputs[0], expected(req_items(1, [3])[0]))
    assert metrics.oom_batches._value.get() == 2
    assert released == ["rs-worker", "rs-worker"]  # the allocator's cache released after each
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 2 and all("OutOfMemoryError: CUDA out of memory" in m for m in lines)


@pytest.mark.parametrize("exc, fault", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "fatal"),
    (RuntimeError("CUDA error: unspecified launch failure"), "fatal"),
    (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( ... )`"), "fatal"),
    (RuntimeError("CUDA error: out of memory"), "oom"),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), "oom"),
    (ValueError("the batch is malformed"), "batch"),
    (RuntimeError("shape '[4, -1]' is invalid for input of size 7"), "batch"),
])
def test_classify_tells_cuda_faults_from_out_of_memory_and_bugs(exc, fault):
    from scheduler.faults import classify

    assert classify(exc) == fault


def test_classify_reads_torch_exception_types():
    import torch

    from scheduler.faults import classify

    assert classify(torch.AcceleratorError("an error the driver reported")) == "fatal"
    assert classify(torch.OutOfMemoryError("allocation failed")) == "oom"
    assert classify(torch.cuda.OutOfMemoryError("allocation failed")) == "oom"

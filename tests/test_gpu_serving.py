"""Serving on a real GPU: what the CPU tests can only imitate (gpu-marked; skipped without CUDA,
run on a GPU machine by ``python -m benchmarks.gpu_check``, which reports them in its "serving"
section).

- a real device-side fault (an out-of-range gather) ends a serving process with status 70, what
  was pending gets WorkerDead (HTTP 503), admission closes (scheduler/faults.py);
- device memory reserved after load stays within RESERVED_BOUND of the weights (models/checkpoint/loader.py);
- the two-thread pipeline on CUDA (prep thread copying batch k+1 while the worker runs batch k)
  answers exactly what a single-thread prepare + run of the same batches answers;
- the prefix cache on the device: eviction, then reuse, every output equal to the cache-off run;
- the warm-up makes the first request no slower than 2x the tenth (models/warmup.py);
- a real out-of-memory fails only its batch, is counted, and the server's next batch runs;
- `auto` sizes the prefix cache from the device memory free after the largest batch;
- a batch of 65,535 one-token items (the most a batch may hold) runs on the device.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from models import load_runner
from scheduler import Scheduler

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
# reserved <= weights * 1.05 + 64 MiB after load: one 2 MiB-rounded segment per parameter and the
# rotary tables; a loader that fused on the device would strand about the q/k/v and gate/up parts.
RESERVED_BOUND = (1.05, 64 << 20)

# The child: a scheduler over a CUDA runner whose second batch does an out-of-range gather.
_FAULT_CHILD = r"""
import asyncio, os, sys, torch
from models import load_runner
from scheduler import Scheduler, WorkerDead
from scheduler.faults import DeviceFault

runner = load_runner(sys.argv[1], device="cuda", prefix_cache_size=0)
real = runner.run

def run(prepared):
    if prepared.n_tokens == 3:  # the poisoned batch: a gather past the end of its source
        src = torch.zeros(8, 4, device="cuda")
        src.index_select(0, torch.full((1,), 1 << 24, device="cuda")).sum().item()
    return real(prepared)

runner.run = run
deaths = []
sched = Scheduler(runner, max_batch_tokens=64, max_batch_requests=1, on_death=deaths.append)
sched.start()

async def go():
    await sched.submit([[1, 2, 3, 4]])
    print("first request served", flush=True)
    doomed = asyncio.ensure_future(sched.submit([[5, 6, 7]]))
    behind = asyncio.ensure_future(sched.submit([[8, 9, 10, 11]]))
    for name, fut in (("faulted", doomed), ("queued", behind)):
        try:
            await fut
            print(name, "SERVED", flush=True)
        except WorkerDead:
            print(name, "got WorkerDead", flush=True)
    try:
        await sched.submit([[1, 2]])
    except WorkerDead:
        print("admission closed", flush=True)

asyncio.run(go())
fault = deaths[0] if deaths else None
print("death:", type(fault).__name__, repr(getattr(fault, "__cause__", None))[:200], flush=True)
os._exit(70 if isinstance(fault, DeviceFault) else 1)
"""


@pytest.fixture(scope="module")
def tiny_dir(fixture_root):
    import fixtures

    return fixtures.cached("tiny-embedding", root=fixture_root)


@pytest.fixture(scope="module")
def qwen06_dir(fixture_root):
    import fixtures

    return fixtures.cached("qwen3-0.6b", root=fixture_root)


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


def _requests(n: int, items: int, length: int, seed: int = 0) -> list[list[list[int]]]:
    """n requests of `items` items each, sharing a prefix of half the length."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        head = rng.integers(10, 5000, length // 2).tolist()
        out.append([head + rng.integers(10, 5000, length - length // 2).tolist() for _ in range(items)])
    return out


def test_a_device_side_fault_ends_the_process_with_status_70(tiny_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", _FAULT_CHILD, str(tiny_dir)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 70, out
    assert "first request served" in out
    assert "faulted got WorkerDead" in out and "queued got WorkerDead" in out, out
    assert "admission closed" in out
    assert "death: DeviceFault" in out and "device-side assert" in out, out


def test_reserved_after_load_is_within_a_bound_of_the_weights(qwen06_dir):
    runner = load_runner(str(qwen06_dir), device="cuda", dtype="bfloat16", prefix_cache_size=0)
    mem = runner.report.memory
    factor, slack = RESERVED_BOUND
    assert mem["allocated_bytes"] >= mem["weights_bytes"]
    assert mem["reserved_bytes"] <= mem["weights_bytes"] * factor + slack, mem


def test_the_two_thread_pipeline_answers_what_one_thread_does(tiny_dir):
    runner = load_runner(str(tiny_dir), device="cuda", dtype="bfloat16", prefix_cache_size=0)
    requests = _requests(8, 4, 96)
    # Each request is its own batch (4 items, FIFO): the same batches as the one-thread run.
    sched = Scheduler(runner, max_batch_tokens=4096, max_batch_requests=4,
                      warm_up=lambda: runner.warm_up(max_tokens=4096))
    sched.start()

    async def all_at_once():
        return await asyncio.gather(*(sched.submit(r) for r in requests))

    try:
        served = asyncio.run(all_at_once())
    finally:
        sched.stop(drain=False, timeout=10)
    for req, res in zip(requests, served):
        want = runner.run(runner.prepare(*_pack(req))).numpy()  # [4, E], this thread alone
        assert np.array_equal(np.stack(res.outputs), want)


def test_prefix_cache_evicts_and_reuses_on_the_device(tiny_dir):
    on = load_runner(str(tiny_dir), device="cuda", dtype="float32", prefix_cache_size="64tokens")
    off = load_runner(str(tiny_dir), device="cuda", dtype="float32", prefix_cache_size=0)
    cache = on.prefix_cache
    assert cache.k.device.type == "cuda" and cache.n_slots == 4
    a, b = _requests(2, 1, 48, seed=3)

    def both(seqs):
        got = on.run(on.prepare(*_pack(seqs)))
        want = off.run(off.prepare(*_pack(seqs)))
        assert (got - want).abs().max().item() < 1e-4
        return cache.stats()

    first = both(a)  # writes A's blocks
    again = both(a)  # reads them
    assert again["hit_tokens"] > first["hit_tokens"]
    evicted = both(b)  # B needs the slots A holds
    assert evicted["evictions"] > 0
    back = both(a)  # A again: recomputed, written, then read
    both(a)
    assert cache.stats()["hit_tokens"] > back["hit_tokens"]


def test_the_first_request_is_within_2x_of_the_tenth(qwen06_dir):
    runner = load_runner(str(qwen06_dir), device="cuda", dtype="bfloat16", prefix_cache_size="auto")
    max_tokens = 4096
    sched = Scheduler(runner, max_batch_tokens=max_tokens, warm_up=lambda: runner.warm_up(max_tokens=max_tokens))
    sched.start()
    requests = _requests(10, 8, 256, seed=7)  # no two share tokens: no prefix-cache hits between them

    async def one_by_one():
        times = []
        for r in requests:
            t0 = time.perf_counter()
            await sched.submit(r)
            times.append(time.perf_counter() - t0)
        return times

    try:
        times = asyncio.run(one_by_one())
    finally:
        sched.stop(drain=False, timeout=10)
    assert times[0] <= 2 * times[9], [round(t * 1e3, 1) for t in times]


def test_a_real_out_of_memory_fails_only_its_batch(tiny_dir):
    from scheduler import BatchFailed
    from scheduler.metrics import Metrics

    runner = load_runner(str(tiny_dir), device="cuda", dtype="bfloat16", prefix_cache_size=0)
    real = runner.run

    def run(prepared):
        if prepared.n_tokens == 3:  # far more than any GPU holds: the allocator raises
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        return real(prepared)

    runner.run = run  # type: ignore[method-assign]
    metrics = Metrics()
    sched = Scheduler(runner, max_batch_tokens=64, metrics=metrics)
    sched.start()

    async def go():
        with pytest.raises(BatchFailed):
            await sched.submit([[5, 6, 7]])
        return await sched.submit([[1, 2, 3, 4]]), sched.alive

    try:
        after, alive = asyncio.run(go())
    finally:
        sched.stop(drain=False, timeout=10)
    assert alive and after.outputs[0].shape == (runner.hidden_size,)
    assert metrics.oom_batches._value.get() == 1


def test_auto_sizes_the_prefix_cache_from_free_device_memory(tiny_dir):
    from models.prefix_cache.size import AUTO_DEVICE_FRACTION

    runner = load_runner(str(tiny_dir), device="cuda", dtype="bfloat16", max_batch_tokens=8192)
    report, cache = runner.report.prefix_cache, runner.prefix_cache
    assert cache is not None and cache.k.device.type == "cuda"
    assert report["why"].startswith(f"auto: {AUTO_DEVICE_FRACTION:.0%} of ") and "8192-token forward" in report["why"]
    total = torch.cuda.get_device_properties(0).total_memory
    assert report["bytes"] <= AUTO_DEVICE_FRACTION * total
    assert report["bytes"] > 0.2 * total  # a tiny model on a big GPU: most of it, not 512 MiB


def test_a_batch_of_65535_one_token_items_runs_on_the_device(tiny_dir):
    runner = load_runner(str(tiny_dir), device="cuda", dtype="bfloat16", prefix_cache_size=0)
    n = 65535
    ids = (np.arange(n, dtype=np.int32) % 1000) + 10
    out = runner.run(runner.prepare(ids, np.arange(n + 1, dtype=np.int32)))  # [n, E]
    one = runner.run(runner.prepare(ids[:1], np.array([0, 1], np.int32)))  # [1, E]
    assert out.shape == (n, runner.hidden_size) and torch.isfinite(out).all()
    assert (out[0] - one[0]).abs().max().item() < 2e-2

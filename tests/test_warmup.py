"""The warm-up runs the serving path on the worker thread before the scheduler admits anything.

A real runner behind a real Scheduler: the warm-up's forwards are seen by a spy on ``Runner.run``
(the thread, the batch's tokens, whether the trie compacted it, the prefix cache's hits); the
cache is empty afterwards, the log line names the thread and the peak memory, and a failed
warm-up fails the start.
"""
from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np
import pytest

from models import load_runner
from models import runner as runner_mod
from models.warmup import CPU_TOKENS, shared_prefix_batch
from scheduler import Scheduler


def _spy(monkeypatch) -> list[dict]:
    seen: list[dict] = []
    real = runner_mod.Runner.run

    def run(self, prepared):
        fb = prepared.forward
        seen.append({"thread": threading.current_thread().name, "tokens": prepared.n_tokens,
                     "rows": prepared.n_compact, "trie": prepared.used_index, "cache": fb.cache is not None,
                     "hits": prepared.n_tokens - sum(prepared.computed_tokens)})
        return real(self, prepared)

    monkeypatch.setattr(runner_mod.Runner, "run", run)
    return seen


def _serve(runner, max_tokens: int, items):
    # inline=False: every forward on the worker, as on an accelerator (a CPU may run a lone batch
    # on the prep thread, where no per-thread handles exist to warm)
    sched = Scheduler(runner, max_batch_tokens=max_tokens, inline=False,
                      warm_up=lambda: runner.warm_up(max_tokens=max_tokens))
    sched.start()  # returns once the warm-up ran
    try:
        stats = runner.prefix_cache.stats()
        out = asyncio.run(sched.submit(items))
    finally:
        sched.stop(drain=False, timeout=5)
    return stats, out


def test_warm_up_runs_the_serving_path_on_the_worker_thread(tiny_embedding_dir, monkeypatch, caplog):
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size="4096tokens")
    seen = _spy(monkeypatch)
    caplog.set_level(logging.INFO, logger="models.warmup")
    stats, out = _serve(runner, 512, [[5, 6, 7, 8]])
    warm, served = seen[:-1], seen[-1]
    assert {s["thread"] for s in seen} == {"rs-worker"}  # cuBLAS handles are per thread
    # 1. the token budget in one batch whose shared prefixes the trie compacts (compact attention)
    assert warm[0]["tokens"] == 512 and warm[0]["trie"] and warm[0]["rows"] < 512 and not warm[0]["cache"]
    # 2. a prefix-cache write, 3. a read of it
    assert warm[1]["cache"] and warm[1]["hits"] == 0
    assert warm[2]["cache"] and warm[2]["hits"] > 0
    assert len(warm) == 3
    # nothing of the warm-up is left in the cache or its counters, before the first request
    assert stats["blocks"] == 0 and stats["hit_tokens"] == 0 and stats["miss_tokens"] == 0
    assert served["hits"] == 0 and out.outputs[0].shape == (runner.hidden_size,)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "models.warmup"]
    assert line.startswith("warm-up on thread rs-worker: ") and "a 512-token batch" in line
    assert "peak RSS" in line and f"{runner.report.warmup_ms:.1f} ms" in line


def test_warm_up_is_capped_on_the_cpu(tiny_reranker_dir, monkeypatch, caplog):
    runner = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32", prefix_cache_size=0)
    seen = _spy(monkeypatch)
    caplog.set_level(logging.INFO, logger="models.warmup")
    figures = runner.warm_up(max_tokens=8192)
    assert [s["tokens"] for s in seen] == [CPU_TOKENS] and figures["tokens"] == CPU_TOKENS
    (line,) = [r.getMessage() for r in caplog.records if r.name == "models.warmup"]
    assert "capped from 8192 on the CPU" in line and "prefix cache not used" in line


def test_shared_prefix_batch_shape():
    ids, cu = shared_prefix_batch(1000, 500, seq=256)
    assert cu.tolist() == [0, 256, 512, 1000] and ids.dtype == np.int32 and ids.max() < 500
    assert all((ids[cu[i]:cu[i] + 128] == ids[:128]).all() for i in range(3))  # the shared half
    assert not (ids[256 + 128:512] == ids[128:256]).all()  # each item's own tail


def test_a_failed_warm_up_fails_the_start(tiny_embedding_dir):
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size=0)
    deaths: list[BaseException] = []

    def broken():
        raise RuntimeError("no memory for the warm-up batch")

    sched = Scheduler(runner, max_batch_tokens=64, warm_up=broken, on_death=deaths.append)
    with pytest.raises(RuntimeError, match="failed to warm up"):
        sched.start()
    assert not sched.alive and len(deaths) == 1 and "no memory" in str(deaths[0])
    sched.stop(drain=False, timeout=1)


def test_the_prefix_cache_size_is_reported_with_its_reason(tiny_embedding_dir):
    from models.prefix_cache.size import AUTO_HOST_TOKENS

    auto = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32").report.prefix_cache
    cfg = load_runner(str(tiny_embedding_dir), device="cpu", prefix_cache_size=0).config
    per = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert auto["bytes_per_token"] == per and auto["bytes"] == auto["tokens"] * per
    assert auto["tokens"] == AUTO_HOST_TOKENS  # a tiny model: the token cap binds
    assert auto["why"].startswith("auto: 25% of ") and "RAM available" in auto["why"]
    fixed = load_runner(str(tiny_embedding_dir), device="cpu", prefix_cache_size="100tokens").report.prefix_cache
    assert fixed == {"tokens": 96, "bytes": 96 * per, "bytes_per_token": per, "why": "--prefix-cache-size 100tokens"}
    off = load_runner(str(tiny_embedding_dir), device="cpu", prefix_cache_size=0).report.prefix_cache
    assert off["tokens"] == 0 and off["why"] == "off: size 0"


def test_a_prefix_cache_that_cannot_fit_fails_at_start(tiny_embedding_dir):
    # checked against the RAM available, whatever the kernel's overcommit policy would allow
    with pytest.raises(ValueError, match="1000TB needs .* GiB, more than the .* GiB of RAM available"):
        load_runner(str(tiny_embedding_dir), device="cpu", prefix_cache_size="1000TB")

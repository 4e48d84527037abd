"""Warm-up: the serving path run once before the first request, on the thread that will serve.

cuBLAS/cuBLASLt handles and workspaces are per thread, the caching allocator grows to the
largest batch's activations, and CUDA modules load on first launch, so the warm-up must run on
the scheduler's worker thread (``Runner.warm_up``, which the scheduler calls there before taking
batches) and go through what serving goes through: a batch at the token budget whose items share
prefixes (the trie, compact attention over its compacted rows), then a prefix-cache write and a
read of it. Invariant: the warm-up leaves no trace a client could see: the cache is reset to
empty (its counters too), and nothing is counted in the metrics (no scheduler step runs it).
Last, on CUDA, the lone-short-input buckets are captured as CUDA graphs, checked and timed
(models/graphs.py), on this thread, the one that replays them.
On a CPU the batch is capped at CPU_TOKENS, two items sharing a prefix (the smallest batch that
runs the trie and compact attention): there are no handles or allocator to grow there, and start-up
time would grow with the batch for nothing.

``peak_forward`` is also how a CUDA runner sizes an `auto` prefix cache: the memory still free
after the largest batch's forward.
"""
from __future__ import annotations

import dataclasses
import logging
import resource
import threading
import time
from typing import Any

import numpy as np
import torch

from models import streams
log = logging.getLogger(__name__)

SEQ_TOKENS = 256  # tokens per warm-up item; the first half is shared by all items
CPU_TOKENS = 2 * SEQ_TOKENS  # the warm-up batch's cap on a CPU


def shared_prefix_batch(tokens: int, vocab: int, *, seq: int = SEQ_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """input_ids int32 [tokens] and cu_seqlens int32 [B+1]: items of `seq` tokens (the last one
    takes the remainder) whose first seq // 2 tokens are the same, the rest each item's own."""
    seq = max(1, min(seq, tokens))
    n = max(1, tokens // seq)
    lens = np.full(n, seq, dtype=np.int64)
    lens[-1] += tokens - seq * n
    shared = seq // 2
    ids = np.empty(tokens, dtype=np.int64)
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    for i in range(n):
        own = np.arange(cu[i + 1] - cu[i], dtype=np.int64)
        own[shared:] += 7919 * (i + 1)  # each item's own tail
        ids[cu[i]:cu[i + 1]] = own
    return (ids * 104729 % max(1, vocab)).astype(np.int32), cu


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    """The peak since `reset_peak`: allocated device memory on CUDA; the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def peak_forward(runner: Any, tokens: int) -> int:
    """One forward of a `tokens`-token batch with shared prefixes, trie on, no cache; the peak bytes."""
    ids, cu = shared_prefix_batch(tokens, runner.config.vocab_size)
    hot = dataclasses.replace(runner, radix_mlp_threshold=1.0, prefix_cache=None)
    reset_peak(runner.device)
    streams.settled(hot.run(hot.prepare(ids, cu)))  # waits for the copy to the host
    return peak_bytes(runner.device)


def warm_cache(runner: Any) -> str:
    """A prefix-cache write then a read of it through the serving path; then an empty cache again."""
    cache = runner.prefix_cache
    if cache is None or not runner.cache_usable():
        return "prefix cache not used"
    block = cache.block
    first, cu = shared_prefix_batch(6 * block, runner.config.vocab_size, seq=3 * block)  # writes
    second = first.copy()
    second[cu[1] - block // 2:cu[1]] += 1  # the same prefixes, other tails: reads what was written
    hot = dataclasses.replace(runner, radix_mlp_threshold=1.0)
    streams.settled(hot.run(hot.prepare(first, cu)))
    streams.settled(hot.run(hot.prepare(second % max(1, runner.config.vocab_size), cu)))
    hits = cache.stats()["hit_tokens"]
    cache.reset()
    return f"prefix cache write and read ({hits} tokens hit), then emptied"


def warm_up(runner: Any, *, max_tokens: int) -> dict:
    """The serving path once, on this thread; sets ``runner.report.warmup_ms``, logs it, returns figures."""
    device = runner.device
    tokens = max_tokens if device.type == "cuda" else min(max_tokens, CPU_TOKENS)
    t0 = time.perf_counter()
    peak = peak_forward(runner, tokens)
    cache_note = warm_cache(runner)
    graphs = runner.graphs
    if graphs is not None and graphs.enabled:  # captured on this thread, after the allocator grew
        model = runner.model
        log.info(graphs.capture_all(lambda b: model(b.input_ids, b.positions, b),
                                    vocab=runner.config.vocab_size, dtype=runner.dtype))
    ms = (time.perf_counter() - t0) * 1e3
    runner.report = dataclasses.replace(runner.report, warmup_ms=ms)
    what = "peak allocated" if device.type == "cuda" else "peak RSS"
    log.info("warm-up on thread %s: %.1f ms; a %d-token batch with shared prefixes (%s attention%s); %s; "
             "%s %.2f GiB", threading.current_thread().name, ms, tokens, runner.radix_attention,
             "" if tokens == max_tokens else f", capped from {max_tokens} on the CPU", cache_note, what,
             peak / 2**30)
    return {"ms": ms, "tokens": tokens, "peak_bytes": peak, "thread": threading.current_thread().name}

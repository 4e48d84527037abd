"""A lone short input on a CPU: the prefix cache or not, torch's threads or one, by measured cost.

A retrieval query arrives alone: a batch of one sequence of a few tens of tokens. Two things that
pay for a large batch may not pay for it, and whether they do depends on the model, the machine
and its load, none known in advance:

- The prefix cache's plan (look-up, pins, the pool's row layout, the lease) is a fixed host cost of
  about a millisecond; what a hit saves is the forward of the tokens it serves (the cache reads
  partial blocks, so no input length is too short to hit).
- Torch's intra-op threads: every parallel region of the forward waits for all of them. For a
  batch this small the regions are many and short, so when another process holds a core, one
  descheduled thread stalls each region: on a 2-core box with one core busy, the tiny fixture's
  prepare and forward took 22 ms on 2 threads and 0.6 ms on one. A larger model's forward of the
  same query runs faster on all of them (the 2-layer Qwen3-0.6B shape, the same box at load ~2:
  11 ms on 2 threads, 19 ms on one).

So the runner measures it: for such a batch (one sequence of at most ``LONE_TOKENS`` tokens, a
CPU runner) it keeps, for each path (``Path``: cache or not where the cache is usable, the
process's threads or one where it has more than one), a moving average of the whole cost,
``prepare`` plus ``run`` (wall time), takes the cheapest, and gives another path one batch in
``TRY_EVERY`` (the paths not chosen in turn) so that a change (the cache turning hot, a neighbour's
load coming or going) is seen. A trial costs its batch the difference, so trials are rare enough
to stay out of the 99th percentile (under 0.5% of lone batches), and each one weighs
``TRIAL_WEIGHT`` in its path's average so that one or two trials suffice to follow a change. A
path not yet measured is tried first, in ``paths`` order; its first batch is not recorded (it
builds that path's kernels: oneDNN primitives for another thread count, the cache's first write).

Invariant: every path computes the same answer to float rounding (the cache is exact; one
thread's forward equals several's, ``tests/test_lone_choice.py``); the choice moves cost only. A
batch without the cache neither reads nor writes it. Forwards never overlap (one worker, and a
batch runs on the prep thread only while the worker holds none), so the runner may set torch's
thread count around one forward. Batches of two or more sequences, longer inputs and CUDA
runners (whose ``run`` only queues the forward, so its time is not the forward's) always take the
cache when it is usable, on every thread.
"""
from __future__ import annotations

import functools
import threading
from typing import NamedTuple

LONE_TOKENS = 32  # two cache blocks: a short query with its instruction
TRY_EVERY = 256  # one lone batch in this many takes a path not chosen
WEIGHT = 0.125  # the moving average's weight of the newest measure on the chosen path
TRIAL_WEIGHT = 0.5  # ... and of a trial's measure (a path not chosen)


class Path(NamedTuple):
    """One way to run a lone short batch."""

    cached: bool  # through the prefix cache
    threads: int  # torch's intra-op threads for its forward


@functools.lru_cache(maxsize=64)  # a handful of (cache, threads) pairs, asked once per lone batch
def paths(cache_usable: bool, threads: int) -> tuple[Path, ...]:
    """The candidates, in the order an unmeasured one is tried: the cache first, then all threads
    first (the defaults of every other batch)."""
    caches = (True, False) if cache_usable else (False,)
    counts = (threads, 1) if threads > 1 else (threads,)
    return tuple(Path(c, t) for c in caches for t in counts)


class LoneChoice:
    """The path of a lone short batch, by the measured cost of each."""

    def __init__(self) -> None:
        self.cost: dict[Path, float] = {}  # seconds per batch, by path (measured ones only)
        self.seen: set[Path] = set()  # paths whose first (unrecorded) batch has run
        self.tried: dict[Path, int] = {}  # the lone batch count at each path's last trial
        self.count = 0
        self._lock = threading.Lock()  # prepare (prep thread) decides, run (worker or prep) records

    @staticmethod
    def applies(num_seqs: int, num_tokens: int) -> bool:
        """Whether a batch of this size is the choice's (the caller checks the device)."""
        return num_seqs == 1 and num_tokens <= LONE_TOKENS

    def choose(self, candidates: tuple[Path, ...]) -> Path:
        """The path of the next lone short batch, among ``candidates`` (from ``paths``)."""
        with self._lock:
            self.count += 1
            for path in candidates:
                if path not in self.cost:
                    return path
            best = min(candidates, key=self.cost.__getitem__)
            if self.count % TRY_EVERY or len(candidates) == 1:
                return best
            others = [p for p in candidates if p != best]
            trial = min(others, key=lambda p: self.tried.get(p, -1))  # the one tried longest ago
            self.tried[trial] = self.count
            return trial

    def record(self, path: Path, seconds: float) -> None:
        """One lone batch's prepare + run, on the path it took."""
        with self._lock:
            if path not in self.seen:
                self.seen.add(path)  # its first batch built its kernels: not a measure of it
                return
            old = self.cost.get(path)
            if old is None:
                self.cost[path] = seconds
                return
            trial = min(self.cost.values()) < old  # a path not chosen: another measures cheaper
            self.cost[path] = old + (TRIAL_WEIGHT if trial else WEIGHT) * (seconds - old)

    def describe(self) -> dict:
        """The figures (tests, benchmarks, the log): ms per batch by path, and the lone batches seen."""
        with self._lock:
            return {"paths": {_name(p): round(s * 1e3, 3) for p, s in self.cost.items()}, "batches": self.count}


def _name(path: Path) -> str:
    return f"{'cache' if path.cached else 'no cache'}, {path.threads} thread{'s' if path.threads > 1 else ''}"

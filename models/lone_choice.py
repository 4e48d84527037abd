"""The prefix cache for a lone short input on a CPU: used when it measures cheaper, skipped otherwise.

A retrieval query arrives alone: a batch of one sequence of a few tens of tokens. For it the prefix
cache's plan (look-up, pins, the pool's row layout, the lease) is a fixed host cost of about a
millisecond, and what a hit saves is the forward of the tokens it serves. Whether that pays
depends on the model's per-token forward cost and on the hit, neither known in advance (the cache
reads partial blocks, so no input length is too short to hit). So the runner measures it: for
such a batch (one sequence of at most ``LONE_TOKENS`` tokens, a CPU runner, the cache usable) it
keeps a moving average of the whole cost, ``prepare`` plus ``run`` (wall time: the forward runs on
torch's threads), with the cache and without, takes the cheaper, and gives the other path one
batch in ``TRY_EVERY`` so that a change (the cache turning hot, another load) is seen. A trial
costs its batch the difference (about a millisecond on a CPU), so trials are rare enough to stay
out of the 99th percentile (under 0.5% of lone batches), and each one weighs ``TRIAL_WEIGHT`` in
its path's average so that one or two trials suffice to follow a change. A path not yet measured
is tried first, the cache's first.

Invariant: both paths compute the same answer (the cache is exact); the choice moves cost only.
A skipped batch neither reads nor writes the cache. Batches of two or more sequences, longer
inputs and CUDA runners (whose ``run`` only queues the forward, so its time is not the forward's)
always use the cache when it is usable.
"""
from __future__ import annotations

import threading

LONE_TOKENS = 32  # two cache blocks: a short query with its instruction
TRY_EVERY = 256  # one lone batch in this many takes the path not chosen
WEIGHT = 0.125  # the moving average's weight of the newest measure on the chosen path
TRIAL_WEIGHT = 0.5  # ... and of a trial's measure (the path not chosen)


class LoneCacheChoice:
    """Cache or not for a lone short batch, by the measured cost of each path."""

    def __init__(self) -> None:
        self.cost: dict[bool, float | None] = {True: None, False: None}  # seconds per batch, by "cached"
        self.count = 0
        self._lock = threading.Lock()  # prepare (prep thread) decides, run (worker or prep) records

    @staticmethod
    def applies(num_seqs: int, num_tokens: int) -> bool:
        """Whether a batch of this size is the choice's (the caller checks the device and the cache)."""
        return num_seqs == 1 and num_tokens <= LONE_TOKENS

    def use_cache(self) -> bool:
        """The path of the next lone short batch."""
        with self._lock:
            self.count += 1
            cached, plain = self.cost[True], self.cost[False]
            if cached is None:
                return True
            if plain is None:
                return False
            best = cached <= plain
            return (not best) if self.count % TRY_EVERY == 0 else best

    def record(self, cached: bool, seconds: float) -> None:
        """One lone batch's prepare + run, on the path it took."""
        with self._lock:
            old, other = self.cost[cached], self.cost[not cached]
            trial = old is not None and other is not None and old > other  # the path not chosen
            self.cost[cached] = seconds if old is None else old + (TRIAL_WEIGHT if trial else WEIGHT) * (seconds - old)

    def describe(self) -> dict:
        """The figures (tests, benchmarks): ms per batch by path, and the lone batches seen."""
        with self._lock:
            return {"cache_ms": _ms(self.cost[True]), "no_cache_ms": _ms(self.cost[False]), "batches": self.count}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)

"""Synthetic prefix-sharing token batches for the forward benchmarks (bench_forward, its A/B tools).

Invariant: a batch is ``batch`` sequences of one shared ``prefix``-token head and their own
``suffix``-token tails, drawn from a seeded generator, so the same arguments give the same ids.
"""
from __future__ import annotations

import numpy as np

MODES = ("off", "paper", "compact")  # the radix modes the forward benchmarks time


def synthetic_batch(batch: int, prefix: int, suffix: int, *, vocab: int, seed: int):
    """-> (ids [batch * (prefix + suffix)] int32, cu_seqlens [batch + 1] int32)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, prefix)
    seqs = [np.concatenate([shared, rng.integers(0, vocab, suffix)]) for _ in range(batch)]
    ids = np.concatenate(seqs).astype(np.int32)
    cu = np.zeros(batch + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu

"""How many leading tokens each sequence of a packed batch shares with the one before it.

The prefix cache's ``plan`` reuses a predecessor's look-ups for the leading blocks two neighbours
share, so a batch sharing a long instruction pays its look-ups once (planner.py).
"""
from __future__ import annotations

import numpy as np


def shared_with_previous(ids: np.ndarray, cu: np.ndarray, namespaces) -> list[int]:
    """[B] leading tokens each sequence shares with the one before it in the batch (0 for the
    first, and across namespaces): one vectorised comparison of the packed ids."""
    n_seq = len(cu) - 1
    if n_seq < 2:
        return [0] * n_seq
    lens = np.diff(cu)
    m = np.minimum(lens[1:], lens[:-1])  # [B-1] tokens compared, >= 1 each
    seg = np.cumsum(m) - m  # [B-1] first compared position of each pair
    within = np.arange(int(m.sum()), dtype=np.int64) - np.repeat(seg, m)  # [sum m]
    differs = ids[np.repeat(cu[1:-1], m) + within] != ids[np.repeat(cu[:-2], m) + within]
    first = np.where(differs, within, np.repeat(m, m))  # a pair's first differing position, or m
    out = [0] + np.minimum.reduceat(first, seg).tolist()
    if namespaces is not None:
        for s in range(1, n_seq):
            if namespaces[s] != namespaces[s - 1]:
                out[s] = 0
    return out

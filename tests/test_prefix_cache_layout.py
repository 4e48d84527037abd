"""A batch's layout against the prefix cache, against its definition recomputed node by node.

models/prefix_cache/layout.py turns a lease into host index arrays and models/batch.py into a
compact batch, both vectorized; here the same results are recounted with plain Python loops over
each sequence's path of trie nodes, straight from the documented rules: m(s) = matched(s) capped
at the shallowest pooled row on its path, a node is read iff its depth < max m(s) over the
sequences through it, the pool's rows come first. The leases are made up (any matched(s) at all,
also ones a look-up never returns, such as different counts for sequences sharing a prefix), so
every branch of the vectorized code is reached; the forward's exactness with real leases is
tests/test_prefix_cache_exact.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.batch import _build_cached
from models.prefix_cache import Lease, PrefixCache
from models.prefix_cache.layout import _layout
from models.trie import build_index, identity_index, positions_from_cu_seqlens

CPU = torch.device("cpu")


def _batch(rng: np.random.Generator):
    """(ids, cu, index): sequences over a tiny alphabet sharing prefixes, some of them prefixes
    of others or duplicates, with the trie, the trie split by groups, or one node per token."""
    base = rng.integers(0, int(rng.integers(1, 4)), size=int(rng.integers(1, 30)))
    seqs = []
    for _ in range(int(rng.integers(1, 9))):
        keep = int(rng.integers(0, len(base) + 1))
        tail = rng.integers(0, 3, size=int(rng.integers(0 if keep else 1, 8)))
        seqs.append(np.concatenate([base[:keep], tail]).astype(np.int64))
    ids = np.concatenate(seqs)
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    kind = rng.integers(3)
    if kind == 0:
        return ids, cu, identity_index(ids, cu)
    groups = rng.integers(0, 2, size=len(seqs)) if kind == 2 else None
    return ids, cu, build_index(ids, positions_from_cu_seqlens(cu), cu, groups=groups)


def _lease(rng: np.random.Generator, cu: np.ndarray, paths: list[list[int]], block: int) -> Lease:
    lens = np.diff(cu)
    matched = rng.integers(0, lens + 1)
    matched[rng.random(len(lens)) < 0.3] = 0  # nothing found
    if rng.random() < 0.3:
        matched = lens.copy()  # every token found
    # one pool row per node, whichever sequence reads it
    read_rows = [5000 + 3 * p[d] for p, k in zip(paths, matched) for d in range(int(k))]
    w = int(rng.integers(0, 6))
    starts = rng.integers(0, int(cu[-1]), size=w)
    lens_w = np.minimum(rng.integers(1, block + 1, size=w), int(cu[-1]) - starts)
    return Lease(matched=matched.astype(np.int64), read_rows=np.asarray(read_rows, dtype=np.int64),
                 write_starts=starts.astype(np.int64), write_slots=rng.integers(0, 4, size=w).astype(np.int64),
                 write_lens=lens_w.astype(np.int64))


@pytest.mark.parametrize("seed", range(4))
def test_layout_and_cached_batch_equal_their_definition(seed):
    rng = np.random.default_rng(seed)
    cache = PrefixCache(layers=1, kv_heads=1, head_dim=2, capacity=64, dtype=torch.float32, device="cpu")
    for _ in range(150):
        ids, cu, index = _batch(rng)
        b, n_nodes = len(cu) - 1, len(index.compact_ids)
        rows_of = index.scatter.tolist()
        paths = [rows_of[cu[s]:cu[s + 1]] for s in range(b)]
        lease = _lease(rng, cu, paths, cache.block)
        plan = _layout(cache, lease, cu, index, CPU)
        fb = _build_cached(cu, index, plan, CPU)

        pooled = {p[-1] for p in paths}
        m = [min(int(k), min(d for d, v in enumerate(p) if v in pooled)) for p, k in zip(paths, lease.matched)]
        reach: dict[int, int] = {}
        depth: dict[int, int] = {}
        owner: dict[int, int] = {}
        for s, p in enumerate(paths):
            for d, v in enumerate(p):
                reach[v] = max(reach.get(v, 0), m[s])
                depth[v] = d
                owner.setdefault(v, s)
        cached = [depth[v] < reach[v] for v in range(n_nodes)]
        for p in paths:  # prefix-closed along every path, the last row never read
            flags = [cached[v] for v in p]
            assert flags == sorted(flags, reverse=True) and not flags[-1]
        order = [v for v in range(n_nodes) if cached[v]] + [v for v in range(n_nodes) if not cached[v]]
        src = {v: i for i, v in enumerate(order)}
        n_read = sum(cached)
        src_of_row = [src[v] for v in rows_of]
        hits = [sum(cached[v] for v in p) for p in paths]

        assert plan.cached.tolist() == cached and plan.n_read == n_read
        assert plan.src_of_row.tolist() == src_of_row and plan.hits.tolist() == hits
        assert (lease.hits, lease.misses) == (sum(hits), int(cu[-1]) - sum(hits))
        want_read = [5000 + 3 * v for v in order[:n_read]]
        assert (plan.io.read_rows.tolist() if plan.io.read_rows is not None else []) == want_read
        blocks = list(zip(lease.write_starts.tolist(), lease.write_slots.tolist(), lease.write_lens.tolist()))
        want_dst = [slot * cache.block + j for _, slot, k in blocks for j in range(k)]
        want_src = [src_of_row[start + j] for start, _, k in blocks for j in range(k)]
        assert (plan.io.write_rows.tolist() if plan.io.write_rows is not None else []) == want_dst
        assert (plan.io.write_src.tolist() if plan.io.write_src is not None else []) == want_src

        computed = order[n_read:]  # node order: owners ascending, each one's block in depth order
        per_owner = [sum(1 for v in computed if owner[v] == s) for s in range(b)]
        owners = [s for s in range(b) if per_owner[s]]
        assert fb.input_ids.tolist() == [int(index.compact_ids[v]) for v in computed]
        assert fb.positions.tolist() == [int(index.compact_positions[v]) for v in computed]
        assert list(fb.attn.host_cu_seqlens_q) == np.cumsum([0] + [per_owner[s] for s in owners]).tolist()
        assert list(fb.attn.host_cu_seqlens_k) == np.cumsum([0] + [len(paths[s]) for s in owners]).tolist()
        assert fb.kv_index.tolist() == [src_of_row[r] for s in owners for r in range(cu[s], cu[s + 1])]
        assert fb.last_rows.tolist() == [src[p[-1]] - n_read for p in paths]
        assert fb.first_rows.tolist() == [-1 if cached[p[0]] else src[p[0]] - n_read for p in paths]
        assert fb.cached_tokens == tuple(hits) and fb.num_rows == n_nodes - n_read
        plan.io.abort()

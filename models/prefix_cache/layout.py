"""One batch's plan against the prefix cache: may it use the cache, and which of its rows the pool
serves and which it writes.

Invariant: `plan_batch` is the batch's one entry into the cache. It walks the input_ids once
(`PrefixCache.plan`: look-up, pins, the blocks to write) and turns the lease into host index
arrays over the batch's trie nodes; whatever fails after the look-up gives the lease back.
A node is read from the pool iff its depth < max m(s) over the sequences s through it, m(s) the
tokens of s the cache holds capped below every pooled row on its path: that set is prefix-closed
along every path, so each owner's computed nodes stay a suffix of its block and compact
attention's bottom-right alignment stays exact.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.streams import to_device
from models.prefix_cache.blocks import Lease, PrefixCache
from models.prefix_cache.io import CacheIO
from models.trie import RadixIndex


def cache_refusal(*, radix_attention: str, pooling: str, all_tokens: bool = False) -> str | None:
    """Why a batch may not use the prefix cache, or None when it may: the one eligibility rule.

    Cached tokens have K/V rows in the pool but no hidden state, so the cache serves compact
    attention whose head reads each sequence's last row only. `pooling` is the row the head reads
    ("last-token" for a reranker); `all_tokens`: some item answers every token's state.
    """
    if radix_attention != "compact":
        return f"radix_attention={radix_attention} (it needs compact attention)"
    if pooling != "last-token":
        return (f"pooling={pooling} (it reads rows of every token, or the first; cached rows have "
                "no hidden state)")
    if all_tokens:
        return "all_tokens items (they read every token's state; cached rows have none)"
    return None


@dataclass(frozen=True)
class CachePlan:
    """The pool's part of one compact batch, host side, plus the device reads/writes (`io`)."""

    io: CacheIO  # holds the lease: commit after the forward, abort otherwise
    cached: np.ndarray  # [N'] bool trie nodes read from the pool instead of computed
    src_of_row: np.ndarray  # [N] int64 row of each original row in [pool rows read | new rows]
    n_read: int  # P, pool rows read
    hits: np.ndarray  # [B] int64 tokens of each sequence read from the pool


def plan_batch(cache: PrefixCache, ids: np.ndarray, cu: np.ndarray, index: RadixIndex,
               device: torch.device, namespaces=None) -> CachePlan:
    """Look the batch up (pinning what it reads) and lay out its pool reads and writes.

    ids [N] int64, cu [B+1] int64 (checked by the caller); index: the batch's trie, or
    `identity_index` (one node per token) when the trie gate left it out; namespaces: None or
    [B] bytes (`PrefixCache.plan`), and then the trie must not share nodes across namespaces.
    """
    lease = cache.plan(ids, cu, namespaces)
    try:
        return _layout(cache, lease, cu, index, device)
    except BaseException:
        cache.abort(lease)
        raise


def _layout(cache: PrefixCache, lease: Lease, cu: np.ndarray, index: RadixIndex,
            device: torch.device) -> CachePlan:
    n, starts = int(cu[-1]), cu[:-1]
    lens = cu[1:] - starts  # [B]
    rows_of = np.asarray(index.scatter).astype(np.int64)  # [N] node of each original row (once)
    n_nodes = len(index.compact_ids)
    # [B] m(s): matched(s) capped at the shallowest depth on its path whose node is a pooled row.
    # Its own last row is one (depth len(s) - 1); another sequence's, at depth len(s') - 1, can
    # only cap it lower when len(s') - 1 < matched(s).
    m = np.minimum(lease.matched, lens - 1)
    if len(lens) and int(m.max()) > int(lens.min()) - 1:
        is_last = np.zeros(n_nodes, dtype=bool)
        is_last[rows_of[cu[1:] - 1]] = True
        # the first row on a pooled node at or after each sequence's start (its last row at most)
        pooled = np.flatnonzero(is_last.take(rows_of))  # [K] ascending original rows
        np.minimum(m, pooled[np.searchsorted(pooled, starts)] - starts, out=m)
    # rows whose K/V this batch may take from the pool: the first m(s) of each sequence, row
    # (s, d) at read_rows[offset(s) + d]; concatenated ranges as one arange plus a per-range shift
    first_readable = np.cumsum(m)
    n_readable = int(first_readable[-1]) if len(m) else 0
    first_readable -= m  # [B] index of each sequence's first readable row
    steps = np.arange(n_readable, dtype=np.int64)  # [R]
    readable = np.repeat(starts - first_readable, m) + steps  # [R] original rows, ascending
    if n_readable == len(lease.read_rows):  # m == matched: every matched row is read
        pool_readable = lease.read_rows
    else:
        offset = np.cumsum(lease.matched) - lease.matched  # [B]
        pool_readable = lease.read_rows[np.repeat(offset - first_readable, m) + steps]  # [R]
    # [N'] nodes read from the pool: those of a readable row; a node's rows all share its depth, so
    # this is depth < max m(s) over the sequences through it, prefix-closed along every path
    pool_row = np.full(n_nodes, -1, dtype=np.int64)  # [N'] pool row read for each node, or -1
    pool_row[rows_of.take(readable)] = pool_readable
    cached = pool_row >= 0
    keep = ~cached
    n_read = int(np.count_nonzero(cached))
    src = np.empty(n_nodes, dtype=np.int64)  # [N'] row of each node in [pool rows read | new rows]
    src[cached] = np.arange(n_read)
    src[keep] = np.arange(n_read, n_nodes)
    src_of_row = src.take(rows_of)  # [N]
    # [B] cached rows of each sequence: a prefix of it, at least its m(s) readable rows, and just
    # those unless the node at depth m(s) on its path (a row it has: m(s) < len(s)) is cached
    hits = m
    if len(m) and int(src_of_row[starts + m].min()) < n_read:
        hits = _segment_sum(src_of_row < n_read, cu)
    lease.hits = int(hits.sum())
    lease.misses = n - lease.hits

    def dev(a: np.ndarray) -> Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), device)

    write_rows = write_src = None
    n_written = int(lease.write_lens.sum())
    if n_written:
        # written rows, block by block: write_lens[w] rows (block, or t for a tail) from original
        # row write_starts[w] into slot write_slots[w]: original row -> source row, slot -> pool row
        lens_w = lease.write_lens
        first_w = np.cumsum(lens_w) - lens_w  # [W] index of each block's first written row
        steps_w = np.arange(n_written, dtype=np.int64)  # [sum lens]
        write_rows = dev(np.repeat(lease.write_slots * cache.block - first_w, lens_w) + steps_w)
        write_src = dev(src_of_row.take(np.repeat(lease.write_starts - first_w, lens_w) + steps_w))
    io = CacheIO(cache=cache, lease=lease, read_rows=dev(pool_row[cached]) if n_read else None,
                 write_rows=write_rows, write_src=write_src)
    # A batch dropped before it ran (or never settled) gives its pins and pending rows back.
    weakref.finalize(io, cache.abort, lease)
    return CachePlan(io=io, cached=cached, src_of_row=src_of_row, n_read=n_read, hits=hits)


def _segment_sum(values: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """[B] int64 sum of values (bool or int) over each sequence's rows (every sequence has >= 1 row)."""
    if len(cu) == 1:
        return np.zeros(0, np.int64)
    return np.add.reduceat(values, cu[:-1], dtype=np.int64)

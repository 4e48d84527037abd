"""ForwardBatch: everything one ragged forward needs, built on the host before the model runs.

Invariant: all index arithmetic happens here, in numpy, on the scheduler's CPU thread; the
forward only reads tensors and Python ints (no .item()/.tolist() on device tensors).
"Rows" are the rows the model runs on: N original tokens in mode "off", N' compact tokens in
"paper"/"compact". `last_rows`/`first_rows` index those rows.
With a prefix cache (compact mode only) the rows are the N' nodes minus those read from the
cache; each layer's keys come from [pool rows read | new rows] and kv_index indexes that.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from models.attention import AttnMeta, make_meta, to_device
from models.prefix_cache import Lease, PrefixCache
from models.tree_attention import TreeAttention

MODES = ("off", "paper", "compact")


@dataclass(frozen=True)
class ForwardBatch:
    mode: str  # "off" | "paper" | "compact"
    input_ids: Tensor  # [T] int64, T = N (off) or N' (radix)
    positions: Tensor  # [T] int64
    attn: AttnMeta  # the attention call's boundaries (full sequences, or owners in compact)
    num_seqs: int  # B
    num_tokens: int  # N, original tokens
    seq_lens: tuple[int, ...]  # [B] original lengths, host
    last_rows: Tensor  # [B] int64 row of each sequence's last token
    first_rows: Tensor  # [B] int64 row of each sequence's first token
    scatter: Tensor | None  # paper: [N] int64 compact row of each original row (Q/K/V to N)
    gather: Tensor | None  # paper: [N'] int64 an original row of each compact row (output back)
    kv_index: Tensor | None  # [sum owner lengths] int64 compact rows of each owner's keys
    mean_weights: Tensor | None  # [B, T] sparse COO: multiplicity / length (mean pooling)
    cache: CacheIO | None = None  # pool reads/writes of this batch (compact mode with a cache)
    cached_tokens: tuple[int, ...] = ()  # [B] tokens of each sequence read from the cache
    # compact mode: kv_index on the host (the tree-attention planner reads it), and the batch's
    # tree plan when one is attached (models/tree_attention.py; None: per-owner key gather)
    kv_host: np.ndarray | None = None
    tree: TreeAttention | None = None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def computed_tokens(self) -> tuple[int, ...]:
        """[B] tokens of each sequence not served by the prefix cache (len - cached)."""
        if not self.cached_tokens:
            return self.seq_lens
        return tuple(n - c for n, c in zip(self.seq_lens, self.cached_tokens))

    @property
    def cache_hit_tokens(self) -> int:
        return sum(self.cached_tokens)

    @property
    def cache_miss_tokens(self) -> int:
        """Tokens the cache did not serve (0 without a cache: nothing was looked up)."""
        return self.num_tokens - self.cache_hit_tokens if self.cache is not None else 0


def _positions(cu: np.ndarray) -> np.ndarray:
    lens = np.diff(cu)
    return (np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lens))


def _mean_weights(rows: np.ndarray, lens: np.ndarray, num_rows: int,
                  device: torch.device) -> torch.Tensor:
    """Sparse [B, T] on `device`: 1/len_b at (b, row) for every original token of sequence b.

    Built coalesced on the host (sorted by (b, row)) and moved as two dense tensors, so a CUDA
    batch needs no blocking copy and no device-side coalesce.
    """
    seg = np.repeat(np.arange(len(lens), dtype=np.int64), lens)  # [N]
    vals = np.repeat(1.0 / np.maximum(lens, 1), lens).astype(np.float32)  # [N]
    # NOTE: a sequence never holds one compact row twice (positions differ), so there are no
    # duplicates; sorting is all coalescing needs (the index builder does not promise ascending
    # rows per sequence).
    order = np.lexsort((rows, seg))
    idx = torch.from_numpy(np.stack([seg[order], rows.astype(np.int64)[order]]))  # [2, N]
    return torch.sparse_coo_tensor(to_device(idx, device),
                                   to_device(torch.from_numpy(vals[order]), device),
                                   (len(lens), num_rows), check_invariants=False,
                                   is_coalesced=True)


def _checked(input_ids, cu_seqlens) -> tuple[np.ndarray, np.ndarray]:
    """(ids [N] int64, cu [B+1] int64) after checking they describe one ragged batch."""
    ids = np.asarray(input_ids).astype(np.int64, copy=False)
    cu = np.asarray(cu_seqlens).astype(np.int64, copy=False)
    lens = np.diff(cu)
    if ids.shape[0] != int(cu[-1]):
        raise ValueError(f"input_ids has {ids.shape[0]} tokens, cu_seqlens says {int(cu[-1])}")
    if len(lens) and lens.min() <= 0:
        raise ValueError("every sequence needs at least one token")
    return ids, cu


def build_forward_batch(input_ids, cu_seqlens, index=None, *, mode: str = "compact",
                        device: torch.device | str = "cpu", mean_pooling: bool = False,
                        cache: PrefixCache | None = None) -> ForwardBatch:
    """Host-side builder. input_ids [N] int, cu_seqlens [B+1] int, index RadixIndex-shaped or None.

    With index=None the mode is "off" whatever `mode` says, unless a `cache` is given (compact
    mode only): then index=None means one node per token (no in-batch sharing), and the batch
    holds a lease on the cache that `cache.commit()`/`abort()` must settle (dropping the batch
    aborts it).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    device = torch.device(device)
    ids, cu = _checked(input_ids, cu_seqlens)
    lens = np.diff(cu)
    n, b = int(cu[-1]), len(lens)
    if cache is not None:
        if mode != "compact" or mean_pooling:
            raise ValueError("the prefix cache needs compact attention and no mean pooling")
        lease = cache.plan(ids, cu)
        try:
            return _build_cached(ids, cu, index, cache, lease, device)
        except BaseException:
            cache.abort(lease)
            raise
    if index is None or mode == "off":
        mode = "off"
        row_ids, positions = ids, _positions(cu)
        rows_of = np.arange(n, dtype=np.int64)  # [N] model row of each original row
        cu_q = cu_k = cu
        scatter = gather = kv_index = None
    else:
        row_ids = np.asarray(index.compact_ids).astype(np.int64)
        positions = np.asarray(index.compact_positions).astype(np.int64)
        rows_of = np.asarray(index.scatter).astype(np.int64)
        gather = np.asarray(index.gather).astype(np.int64)
        scatter, kv_index = rows_of, None
        if mode == "paper":
            cu_q = cu_k = cu
        else:
            owners = np.asarray(index.owners).astype(np.int64)
            cu_q = np.asarray(index.cu_seqlens_q).astype(np.int64)
            owner_lens = lens[owners]
            cu_k = np.concatenate([[0], np.cumsum(owner_lens)])
            # kv_index = concat of scatter[cu[s]:cu[s+1]] over owners s, without a Python loop.
            starts = np.repeat(cu[owners] - cu_k[:-1], owner_lens)  # [sum owner lens]
            kv_index = rows_of[np.arange(int(cu_k[-1]), dtype=np.int64) + starts]
            scatter = gather = None  # compact attention needs neither
    last = rows_of[cu[1:] - 1] if b else np.zeros(0, np.int64)
    first = rows_of[cu[:-1]] if b else np.zeros(0, np.int64)

    def dev(a: np.ndarray | None, dtype=torch.int64):
        if a is None:
            return None
        return to_device(torch.from_numpy(np.ascontiguousarray(a)).to(dtype), device)

    attn = make_meta(cu_q, cu_k, device)
    weights = _mean_weights(rows_of, lens, len(row_ids), device) if mean_pooling else None
    return ForwardBatch(
        mode=mode, input_ids=dev(row_ids), positions=dev(positions), attn=attn, num_seqs=b,
        num_tokens=n, seq_lens=tuple(int(x) for x in lens), last_rows=dev(last),
        first_rows=dev(first), scatter=dev(scatter), gather=dev(gather), kv_index=dev(kv_index),
        mean_weights=weights, kv_host=kv_index,
    )


def _segment_sum(values: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """[B] sum of values over each sequence's rows (every sequence has >= 1 row)."""
    return np.add.reduceat(values, cu[:-1]) if len(cu) > 1 else np.zeros(0, values.dtype)


def _build_cached(ids: np.ndarray, cu: np.ndarray, index, cache: PrefixCache, lease,
                  device: torch.device) -> ForwardBatch:
    """Compact batch whose cached nodes are read from the pool instead of computed.

    Sequence s may read its first m(s) tokens, m(s) = its cached rows (full blocks, then a partial
    block's leading rows) capped below the depth of
    any node on its path that is some sequence's last token (pooled rows must be computed; this
    covers m(s) <= len(s) - 1). A node is cached iff its depth < max m over the sequences through
    it: that set is prefix-closed along every path, so the computed nodes of each owner remain a
    suffix of its block and compact attention's bottom-right alignment stays exact.
    """
    lens = np.diff(cu)
    n, b = int(cu[-1]), len(lens)
    depth = _positions(cu)  # [N]
    seq = np.repeat(np.arange(b, dtype=np.int64), lens)  # [N]
    if index is None:  # one node per token; each sequence owns all of its rows
        node_ids, node_pos, rows_of = ids, depth, np.arange(n, dtype=np.int64)
        owner_of_node = seq
    else:
        node_ids = np.asarray(index.compact_ids).astype(np.int64)
        node_pos = np.asarray(index.compact_positions).astype(np.int64)
        rows_of = np.asarray(index.scatter).astype(np.int64)
        owners = np.asarray(index.owners).astype(np.int64)
        owner_of_node = np.repeat(owners, np.diff(np.asarray(index.cu_seqlens_q).astype(np.int64)))
    n_nodes = len(node_ids)
    last_node = rows_of[cu[1:] - 1]  # [B]
    is_last = np.zeros(n_nodes, dtype=bool)
    is_last[last_node] = True
    # [B] shallowest depth on each path whose node is a pooled row (its own last token at most)
    cap = np.minimum.reduceat(np.where(is_last[rows_of], depth, n), cu[:-1]) if b else lens
    m = np.minimum(lease.matched, cap)  # [B]
    readable = depth < m[seq]  # [N] rows whose K/V this batch may take from the pool
    reach = np.zeros(n_nodes, dtype=np.int64)
    np.maximum.at(reach, rows_of, m[seq])
    cached = node_pos < reach  # [N'] nodes read from the pool, prefix-closed along every path
    pool_row = np.full(n_nodes, -1, dtype=np.int64)
    # row (s, d) with d < m(s) <= matched(s) sits at read_rows[offset(s) + d]
    offset = np.concatenate([[0], np.cumsum(lease.matched)[:-1]])
    pool_row[rows_of[readable]] = lease.read_rows[offset[seq[readable]] + depth[readable]]
    keep = ~cached
    n_read, n_new = int(cached.sum()), int(keep.sum())
    src = np.empty(n_nodes, dtype=np.int64)  # [N'] row of each node in [pool rows read | new rows]
    src[cached] = np.arange(n_read)
    src[keep] = n_read + np.arange(n_new)
    src_of_row = src[rows_of]  # [N]
    n_computed = np.bincount(owner_of_node[keep], minlength=b)  # [B] new rows each sequence owns
    owners = np.flatnonzero(n_computed)  # ascending = compact order (owners come in batch order)
    cu_q = np.concatenate([[0], np.cumsum(n_computed[owners])])
    owner_lens = lens[owners]
    cu_k = np.concatenate([[0], np.cumsum(owner_lens)])
    starts = np.repeat(cu[owners] - cu_k[:-1], owner_lens)  # [sum owner lens]
    kv_index = src_of_row[np.arange(int(cu_k[-1]), dtype=np.int64) + starts]
    # NOTE: a cached first token has no hidden row (-1 makes cls pooling fail loudly; the runner
    # turns the cache off for cls and mean pooling).
    first = np.where(cached[rows_of[cu[:-1]]], -1, src_of_row[cu[:-1]] - n_read)
    last = src_of_row[cu[1:] - 1] - n_read  # never cached: m(s) stays below every pooled row
    # written rows, block by block: write_lens[w] rows (block, or t for a tail) from original row
    # write_starts[w] into slot write_slots[w]: original row -> source row, pool slot -> pool row
    lens_w = lease.write_lens
    within = np.arange(int(lens_w.sum())) - np.repeat(np.cumsum(lens_w) - lens_w, lens_w)  # [sum lens]
    rows_w = np.repeat(lease.write_starts, lens_w) + within
    dst_w = np.repeat(lease.write_slots * cache.block, lens_w) + within
    hits = _segment_sum(cached[rows_of].astype(np.int64), cu)  # [B]
    lease.hits, lease.misses = int(hits.sum()), n - int(hits.sum())

    def dev(a: np.ndarray) -> Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), device)

    io = CacheIO(cache=cache, lease=lease, read_rows=dev(pool_row[cached]) if n_read else None,
                 write_rows=dev(dst_w) if dst_w.size else None,
                 write_src=dev(src_of_row[rows_w]) if dst_w.size else None)
    # A batch dropped before it ran (or never settled) gives its pins and pending rows back.
    weakref.finalize(io, cache.abort, lease)
    return ForwardBatch(
        mode="compact", input_ids=dev(node_ids[keep]), positions=dev(node_pos[keep]),
        attn=make_meta(cu_q, cu_k, device), num_seqs=b, num_tokens=n,
        seq_lens=tuple(int(x) for x in lens), last_rows=dev(last), first_rows=dev(first),
        scatter=None, gather=None, kv_index=dev(kv_index), mean_weights=None,
        cache=io, cached_tokens=tuple(int(x) for x in hits), kv_host=kv_index,
    )


GatherPair = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class CacheIO:
    """What one batch's attention layers read from and write to the pool (device index tensors).

    Each layer's K/V source is [pool rows read | the batch's new rows], [P + T, Hkv, D]; the
    batch's kv_index and `write_src` index that source.
    """

    cache: PrefixCache
    lease: Lease
    read_rows: Tensor | None  # [P] int64 pool rows this batch reads (None: it reads none)
    write_rows: Tensor | None  # [sum write_lens] int64 pool rows this batch writes
    write_src: Tensor | None  # [sum write_lens] int64 row of the source holding each written row

    def extend(self, layer: int, k: Tensor, v: Tensor, gather_pair: GatherPair) -> tuple[Tensor, Tensor]:
        """k, v [T, Hkv, D] -> [P + T, Hkv, D], storing this layer's new blocks on the way."""
        if self.read_rows is not None:
            kp, vp = gather_pair(self.cache.k[layer], self.cache.v[layer], self.read_rows)  # [P, Hkv, D]
            k, v = torch.cat((kp, k)), torch.cat((vp, v))
        if self.write_rows is not None:
            # NOTE: detached: the pool is a constant to autograd, never part of a graph.
            self.cache.k[layer].index_copy_(0, self.write_rows, k.detach().index_select(0, self.write_src))
            self.cache.v[layer].index_copy_(0, self.write_rows, v.detach().index_select(0, self.write_src))
        return k, v

    def commit(self) -> None:
        self.cache.commit(self.lease)

    def abort(self) -> None:
        self.cache.abort(self.lease)

"""The prefix cache's block index and pool: which token blocks are cached, and their K/V rows.

Structure: a persistent radix tree whose edges are fixed blocks of `block` tokens (16), keyed
exactly by (parent block id, the block's token ids as bytes). A dict lookup compares that key in
full, and block ids are never reused, so a hit is always the very same token prefix from position
0: there is no hash to collide and no way to return another prefix's rows. Each block owns
`block` consecutive rows of a pool preallocated at start, K and V [layers, rows, Hkv, D], holding
K after q/k-norm and rotary at absolute positions, so its rows are valid for any sequence that
starts with the same tokens. The K/V row of a position depends only on the tokens up to it, so a
sequence that matches the first k (1..block-1) tokens of a cached child of its last fully matched
block reads those k rows too (a partial match); each parent keeps its committed children's
token bytes sorted (its `kids`, siblings.py), so the longest such k is one bisection whatever the
number of siblings (every pair after the reranker template shares one parent). A sequence writes
its complete blocks that are not cached (including the block it read partially: its own version
differs from the cached one past the shared tokens) and its tail, the t < block tokens after its
last complete block, as a *tail block*: a leaf holding t rows in a whole slot, keyed by its t
tokens (so no full-width look-up ever finds it) and found only by the partial look-up. A tail is
not written when a committed block already starts with those tokens. Tails let short inputs share
a prefix that ends mid-block: a 20-token instruction followed by each query's own words is read
to its 20th token by the next query, not the 16th.

Cost: `plan` (its steps in planner.py) walks each sequence's blocks once, and a sequence reuses
the blocks its predecessor in the batch looked up or chose to write for the leading blocks they
share (found by one vectorised comparison of the packed ids), so a batch sharing a long
instruction pays its look-ups once; past a sequence's first new block no pending block can sit
under its chain, so its deeper blocks are made without a look-up, and a partial look-up asking
the previous sequence's question (same parent, same tokens) reuses its answer. A lease pins each
block it reads once, whatever the number of its sequences through that block. Eviction pops the
least recently used unpinned block from `EvictionOrder` (eviction.py), O(1) and always a leaf,
without scanning pinned or inner blocks. `commit` is one dict insert, one sorted-list insert and
one O(1) move in the eviction order per block.

Invariants:
- Chains are prefix-closed: a committed block's parent is committed, and a lease pins whole
  chains (a pinned block's parent is pinned by the same lease). Eviction takes unpinned leaves
  only, least recently used first (eviction.py states the order exactly).
- Look-ups see committed blocks only. A batch pins (refcount) every block it reads, and its own
  new blocks stay private (pending) until its lease is committed, after its forward succeeded;
  `abort` (a failed or dropped batch) unpins and frees them, so rows never become reachable half
  written. `commit_later` (the model worker, once the forward ran or is queued ahead of every later
  reader on the device's stream) only queues the lease: the next `plan` (the prep thread), `stats`,
  `commit` or `reset` publishes it, under the lock, before anything else.
- The index is locked: the prep thread plans batch N+1 while the worker runs batch N.
- Namespaces: a sequence planned with a namespace (bytes, e.g. a digest of a request's cache
  salt) starts its chain at that namespace's root instead of the shared root 0; a first block's
  key holds its root, and every deeper key its parent's id, so no look-up, full or partial, ever
  crosses from one namespace into another.
"""
from __future__ import annotations

import collections
import itertools
import threading

import numpy as np
import torch

from models.prefix_cache.eviction import EvictionOrder
from models.prefix_cache.lease import Block, Lease
from models.prefix_cache.planner import BatchPlanner
from models.prefix_cache.shared import shared_with_previous
from models.prefix_cache.siblings import Siblings, added, removed
from models.prefix_cache.size import bytes_per_token

BLOCK_TOKENS = 16


class PrefixCache:
    """The pool and its block index; `plan` on the prep thread, the lease settled after the run."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, block: int = BLOCK_TOKENS):
        if capacity < block:
            raise ValueError(f"prefix cache needs at least one block of {block} tokens, got {capacity}")
        self.block, self.n_slots = block, capacity // block
        self.bytes_per_token = bytes_per_token(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                                               dtype=dtype)
        rows = self.n_slots * block
        # NOTE: on CUDA zeros, not empty: the memory is committed now, so a pool too large fails at
        # start (the fill is a fast memset). On a CPU empty: zeroing would touch every page of a
        # pool of gigabytes at start-up (seconds), while rows are read only after they are written;
        # the kernel still refuses an allocation far beyond the machine's memory at once.
        alloc = torch.zeros if torch.device(device).type == "cuda" else torch.empty
        self.k = alloc(layers, rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = alloc(layers, rows, kv_heads, head_dim, dtype=dtype, device=device)
        self._index: dict[tuple[int | bytes, bytes], Block] = {}
        self._siblings = Siblings()  # the roots' committed children (a block holds its own `kids`)
        self._order = EvictionOrder()  # unpinned committed blocks, least recently used first
        self._plans = 0  # plans so far: a block's `mark`
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._ids = itertools.count(1)  # 0 is the root
        self._lock = threading.RLock()
        # leases whose forward ran, waiting to be published (appended without the lock)
        self._queued: collections.deque[Lease] = collections.deque()
        self.hits = self.misses = self.evictions = 0

    @property
    def capacity_bytes(self) -> int:
        return self.n_slots * self.block * self.bytes_per_token

    @property
    def bytes_in_use(self) -> int:
        """Committed and pending blocks (the rows that cannot be handed out)."""
        return (self.n_slots - len(self._free)) * self.block * self.bytes_per_token

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._publish_queued()
            return {"hit_tokens": self.hits, "miss_tokens": self.misses,
                    "evictions": self.evictions, "bytes": self.bytes_in_use,
                    "capacity_bytes": self.capacity_bytes, "blocks": len(self._index)}

    # -- planning (prep thread) -----------------------------------------------------------------
    def plan(self, input_ids: np.ndarray, cu_seqlens: np.ndarray, namespaces=None) -> Lease:
        """Look up every sequence's cached prefix (pinning it) and choose the blocks to write:
        the steps are planner.py's.

        namespaces: None, or [B] bytes, each sequence's namespace (b"": the shared one).
        """
        ids = np.ascontiguousarray(np.asarray(input_ids), dtype=np.int32)
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        bounds = cu.tolist()
        shared = shared_with_previous(ids, cu, namespaces)  # [B] leading tokens equal to seq s-1's
        with self._lock:
            self._publish_queued()
            self._plans += 1
            planner = BatchPlanner(index=self._index, siblings=self._siblings, order=self._order,
                                   free=self._free, evict=self._evict, next_id=self._ids.__next__,
                                   block=self.block, raw=ids.tobytes(), mark=self._plans)
            add = planner.add
            for s in range(len(bounds) - 1):
                add(bounds[s], bounds[s + 1], (namespaces[s] or 0) if namespaces is not None else 0, shared[s])
        return planner.lease()

    def _evict(self) -> int | None:
        """The slot of the least recently used unpinned block (a leaf), dropped from the index;
        None when every block is pinned or pending."""
        victim = self._order.pop()
        if victim is None:
            return None
        parent = victim.parent
        if parent is not None:
            del self._index[(parent.id, victim.tokens)]
            parent.kids = removed(parent.kids, victim.tokens)
        else:
            del self._index[(victim.root, victim.tokens)]
            self._siblings.remove(victim.root, victim.tokens)
        self.evictions += 1
        return victim.slot

    # -- settling -------------------------------------------------------------------------------
    def commit_later(self, lease: Lease) -> None:
        """The batch ran (or, on one device stream, is queued ahead of every later reader): its
        lease is published by the next `plan`, `stats`, `commit` or `reset`. O(1), no lock: the
        model worker calls it."""
        lease.queued = True
        self._queued.append(lease)

    def commit(self, lease: Lease) -> None:
        """The batch ran: publish its blocks (a block another batch published meanwhile wins)."""
        with self._lock:
            self._publish_queued()
            self._commit(lease)

    def _publish_queued(self) -> None:
        queued = self._queued
        while queued:
            self._commit(queued.popleft())

    def _commit(self, lease: Lease) -> None:
        if lease.done:
            return
        lease.done = True
        index, siblings, order, free = self._index, self._siblings, self._order, self._free
        same: dict[int, Block] = {}  # pending id -> the committed block it duplicates
        used: list[Block] = []  # blocks published, or duplicated while unpinned: parents first
        for b in lease.pending:  # parents before children
            p = b.parent
            if same and p is not None and p.id in same:
                p = b.parent = same[p.id]
            key = (p.id if p is not None else b.root, b.tokens)
            existing = index.get(key)
            if existing is not None:
                same[b.id] = existing
                free.append(b.slot)
                if not existing.refs:
                    used.append(existing)
                continue
            index[key] = b
            if p is not None:
                p.kids = added(p.kids, b.tokens)
            else:
                siblings.add(b.root, b.tokens)
            used.append(b)
        # the eviction order's newest end, children before parents (eviction.py)
        order.use_all(reversed(used))
        self._unpin(lease)
        self.hits += lease.hits
        self.misses += lease.misses

    def _unpin(self, lease: Lease) -> None:
        """The lease's reads settle: each block it pinned is used now, last pinned first."""
        order = self._order
        for b in reversed(lease.pinned):
            b.refs -= 1
            if not b.refs:
                order.add(b)

    def abort(self, lease: Lease) -> None:
        """The batch failed or was dropped: unpin, and free the rows it may have half written."""
        with self._lock:
            if lease.done or lease.queued:
                return
            lease.done = True
            self._unpin(lease)
            self._free.extend(b.slot for b in lease.pending)

    def reset(self) -> None:
        """Forget every block and zero the counters (the warm-up's made-up prefixes leave no trace).

        Only with no lease open: every slot is then free or held by a committed block.
        """
        with self._lock:
            self._publish_queued()
            if len(self._free) + len(self._index) != self.n_slots or any(b.refs for b in self._index.values()):
                raise RuntimeError("the prefix cache cannot be reset while a batch holds a lease on it")
            self._index.clear()
            self._siblings.clear()
            self._order.clear()
            self._free = list(range(self.n_slots - 1, -1, -1))
            self.hits = self.misses = self.evictions = 0


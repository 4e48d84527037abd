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

Cost: `plan` walks each sequence's blocks once, and a sequence reuses the blocks its predecessor in
the batch looked up or chose to write for the leading blocks they share (found by one vectorised
comparison of the packed ids), so a batch sharing a long instruction pays its look-ups once; past
a sequence's first new block no pending block can sit under its chain, so its deeper blocks are
made without a look-up, and a partial look-up asking the previous sequence's question (same
parent, same tokens) reuses its answer. A lease pins each block it reads once, whatever the
number of its sequences through that block. Eviction pops the least recently used unpinned block
from `EvictionOrder` (eviction.py), O(1) and always a leaf, without scanning pinned or inner
blocks. `commit` is one dict insert, one sorted-list insert and one O(1) move in the eviction
order per block.

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
from dataclasses import dataclass, field

import numpy as np
import torch

from models.prefix_cache.eviction import EvictionOrder
from models.prefix_cache.shared import shared_with_previous
from models.prefix_cache.siblings import Kids, Siblings, added, count, longest, removed, starts_with
from models.prefix_cache.size import bytes_per_token

BLOCK_TOKENS = 16


@dataclass(eq=False, slots=True)
class _Block:
    id: int
    parent: "_Block | None"
    tokens: bytes  # the block's token ids, int32: `block` of them, or fewer for a tail block
    depth: int  # block index from position 0
    slot: int  # pool rows slot*block .. slot*block + block - 1
    root: int | bytes = 0  # a first block's parent key: 0, or its namespace (bytes, never an id)
    refs: int = 0  # leases pinning it
    kids: Kids = None  # its committed children's token bytes (siblings.py)
    mark: int = 0  # the last plan that pinned it (a lease pins a block once)

    @property
    def children(self) -> int:
        """Committed children."""
        return count(self.kids)

    @property
    def key(self) -> tuple[int | bytes, bytes]:
        return (self.parent.id if self.parent is not None else self.root, self.tokens)


@dataclass(eq=False)
class Lease:
    """One batch's hold on the cache: the chains it reads (pinned) and the blocks it writes."""

    matched: np.ndarray  # [B] int64 tokens of each sequence found in the cache (full blocks + partial)
    read_rows: np.ndarray  # [sum matched] int64 pool row of each matched token, sequence by sequence
    write_starts: np.ndarray  # [W] int64 original row of each written block's first token
    write_slots: np.ndarray  # [W] int64 pool slot of each written block
    write_lens: np.ndarray  # [W] int64 rows written of each block: block, or t for a tail block
    pinned: list[_Block] = field(default_factory=list)  # each block read, once
    pending: list[_Block] = field(default_factory=list)  # parents before children
    hits: int = 0  # tokens read from the cache, set by layout.plan_batch
    misses: int = 0
    done: bool = False  # committed or aborted
    queued: bool = False  # handed to `commit_later`: only a commit settles it now


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
        self._index: dict[tuple[int | bytes, bytes], _Block] = {}
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
        """Look up every sequence's cached prefix (pinning it) and choose the blocks to write.

        namespaces: None, or [B] bytes, each sequence's namespace (b"": the shared one).
        """
        ids = np.ascontiguousarray(np.asarray(input_ids), dtype=np.int32)
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        blk, width = self.block, 4 * self.block
        n_seq = len(cu) - 1
        bounds = cu.tolist()
        raw = ids.tobytes()  # the batch's tokens: row r is raw[4r:4r+4]
        shared = shared_with_previous(ids, cu, namespaces)  # [B] leading tokens equal to seq s-1's
        matched = [0] * n_seq
        run_rows: list[int] = []  # first pool row of each read run (a chain block, or a partial one)
        partial_runs: list[int] = []  # which runs are partial, and their lengths
        partial_lens: list[int] = []
        starts: list[int] = []  # original row of each pending block's first token, in lease.pending order
        slots: list[int] = []  # pool slot of each pending block
        tails: list[int] = []  # which pending blocks are tails, and their lengths
        tail_lens: list[int] = []
        empty = np.zeros(0, np.int64)
        lease = Lease(empty, empty, empty, empty, empty)
        pinned, new_blocks = lease.pinned, lease.pending
        pending: dict[tuple[int | bytes, bytes], _Block] = {}
        index, siblings, free, order = self._index, self._siblings, self._free, self._order
        ids_next, evict = self._ids.__next__, self._evict
        add_new, add_start, add_slot = new_blocks.append, starts.append, slots.append
        prev_nodes: list[_Block] = []  # the previous sequence's full blocks: committed chain, then pending
        prev_rows: list[int] = []  # first pool row of each block of its committed chain
        prev_found = 0
        last_pk: int | bytes | None = None  # the last partial look-up: parent key, query, answer
        last_query = b""
        last_found: tuple[bytes | None, int] = (None, 0)
        with self._lock:
            self._publish_queued()
            self._plans += 1
            mark = self._plans  # a block pinned by this plan carries it: one pin per lease
            for s in range(n_seq):
                a, e = bounds[s], bounds[s + 1]
                n_full = (e - a) // blk
                root: int | bytes = (namespaces[s] or 0) if namespaces is not None else 0
                reuse = min(shared[s] // blk, n_full, len(prev_nodes))  # blocks equal to seq s-1's
                if reuse > prev_found:
                    # past its committed chain seq s-1 missed at the same key: no look-up to redo
                    j, nodes, rows = prev_found, prev_nodes[:reuse], prev_rows
                else:
                    j, nodes, rows = reuse, prev_nodes[:reuse], prev_rows[:reuse]
                    pk = nodes[-1].id if nodes else root
                    at = 4 * a + j * width
                    while j < n_full:
                        found = index.get((pk, raw[at:at + width]))
                        if found is None:
                            break
                        if found.mark != mark:
                            found.mark = mark
                            if not found.refs:
                                order.pin(found)
                            found.refs += 1
                            pinned.append(found)
                        nodes.append(found)
                        rows.append(found.slot * blk)
                        pk, j, at = found.id, j + 1, at + width
                parent = nodes[j - 1] if j else None
                pk = parent.id if parent is not None else root
                run_rows.extend(rows)
                # the last token is always computed, so a partial match needs at most n-1 tokens
                k_max = min(blk - 1, e - 1 - (a + j * blk))
                k = 0
                if k_max > 0:
                    at = 4 * (a + j * blk)
                    query = raw[at:at + 4 * k_max]
                    if pk != last_pk or query != last_query:
                        # NOTE: the same question as the last sequence's gets its answer: during a
                        # plan committed blocks only leave (evicted unpinned), and the one it found
                        # is pinned, so the longest match and its tie-break are unchanged.
                        last_pk, last_query = pk, query
                        last_found = longest(parent.kids if parent is not None else siblings.get(root), query)
                    tokens, k = last_found
                    if tokens is not None:
                        part = index[(pk, tokens)]
                        if part.mark != mark:
                            part.mark = mark
                            if not part.refs:
                                order.pin(part)
                            part.refs += 1
                            pinned.append(part)
                        partial_runs.append(len(run_rows))
                        partial_lens.append(k)
                        run_rows.append(part.slot * blk)
                matched[s] = j * blk + k
                chained = True  # every complete block is cached or written (a tail may follow)
                jj = len(nodes)  # blocks before it: cached, or seq s-1's pending ones (same tokens)
                if jj > j:
                    parent = nodes[jj - 1]
                pk = parent.id if parent is not None else root
                at = 4 * (a + jj * blk)
                fresh = False  # this sequence made a block: no pending block sits under it yet
                while jj < n_full:
                    key = (pk, raw[at:at + width])
                    mine = None if fresh else pending.get(key)
                    if mine is None:
                        slot = free.pop() if free else evict()
                        if slot is None:
                            chained = False  # pool full of pinned blocks: write nothing deeper
                            break
                        mine = _Block(ids_next(), parent, key[1], jj, slot, 0 if parent is not None else root)
                        pending[key] = mine
                        add_new(mine)
                        add_start(a + jj * blk)
                        add_slot(slot)
                        fresh = True
                    nodes.append(mine)
                    parent, pk, jj, at = mine, mine.id, jj + 1, at + width
                tail = e - (a + n_full * blk)
                if chained and tail:
                    pk = parent.id if parent is not None else root
                    key = (pk, raw[4 * (e - tail):4 * e])
                    # not cached (no committed block starts with it), not being written
                    if (fresh or key not in pending) and \
                            not starts_with(parent.kids if parent is not None else siblings.get(root), key[1]):
                        slot = free.pop() if free else evict()
                        if slot is not None:
                            mine = _Block(ids_next(), parent, key[1], n_full, slot, 0 if parent is not None else root)
                            pending[key] = mine
                            tails.append(len(new_blocks))
                            tail_lens.append(tail)
                            add_new(mine)
                            add_start(e - tail)
                            add_slot(slot)
                prev_nodes, prev_rows, prev_found = nodes, rows, j
        lease.matched = np.asarray(matched, dtype=np.int64)
        if run_rows:
            lens = np.full(len(run_rows), blk, dtype=np.int64)
            lens[partial_runs] = partial_lens
            within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
            lease.read_rows = np.repeat(np.asarray(run_rows, dtype=np.int64), lens) + within
        lease.write_starts = np.asarray(starts, dtype=np.int64)
        lease.write_slots = np.asarray(slots, dtype=np.int64)
        lease.write_lens = np.full(len(slots), blk, dtype=np.int64)
        lease.write_lens[tails] = tail_lens
        return lease

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
        same: dict[int, _Block] = {}  # pending id -> the committed block it duplicates
        used: list[_Block] = []  # blocks published, or duplicated while unpinned: parents first
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


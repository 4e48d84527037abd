"""The prefix cache's block index and pool: which token blocks are cached, and their K/V rows.

Structure: a persistent radix tree whose edges are fixed blocks of `block` tokens (16), keyed
exactly by (parent block id, the block's token ids as bytes). A dict lookup compares that key in
full, and block ids are never reused, so a hit is always the very same token prefix from position
0: there is no hash to collide and no way to return another prefix's rows. Each block owns
`block` consecutive rows of a pool preallocated at start, K and V [layers, rows, Hkv, D], holding
K after q/k-norm and rotary at absolute positions, so its rows are valid for any sequence that
starts with the same tokens. The K/V row of a position depends only on the tokens up to it, so a
sequence that matches the first k (1..block-1) tokens of a cached child of its last fully matched
block reads those k rows too (a partial match); a second index keys every committed block by
(parent id, its first k tokens) for each k, so finding the longest such k is a binary search of
dict look-ups whatever the number of siblings (every pair after the reranker template shares one
parent). A sequence writes its complete blocks that are not cached (including the block it read
partially: its own version differs from the cached one past the shared tokens) and its tail, the
t < block tokens after its last complete block, as a *tail block*: a leaf holding t rows in a
whole slot, keyed by its t tokens (so no full-width look-up ever finds it) and found only by the
partial look-up. A tail is not written when a committed block already starts with those tokens.
Tails let short inputs share a prefix that ends mid-block: a 20-token instruction followed by
each query's own words is read to its 20th token by the next query, not the 16th.

Invariants:
- Chains are prefix-closed: a committed block's parent is committed. Eviction takes unpinned
  leaves only, least recently used first, and touches run child-first (parents more recent).
- Look-ups see committed blocks only. A batch pins (refcount) every block it reads, and its own
  new blocks stay private (pending) until `commit`, after its forward succeeded; `abort` (a failed
  or dropped batch) unpins and frees them, so rows never become reachable half written.
- The index is locked: the prep thread plans batch N+1 while the worker commits batch N.
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

from models.prefix_cache.size import bytes_per_token

BLOCK_TOKENS = 16


@dataclass(eq=False)
class _Block:
    id: int
    parent: "_Block | None"
    tokens: bytes  # the block's token ids, int32: `block` of them, or fewer for a tail block
    depth: int  # block index from position 0
    slot: int  # pool rows slot*block .. slot*block + block - 1
    refs: int = 0
    children: int = 0
    root: int | bytes = 0  # a first block's parent key: 0, or its namespace (bytes, never an id)

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
    pinned: list[_Block] = field(default_factory=list)
    pending: list[_Block] = field(default_factory=list)
    hits: int = 0  # tokens read from the cache, set by layout.plan_batch
    misses: int = 0
    done: bool = False


class PrefixCache:
    """The pool and its block index; `plan` on the prep thread, `commit`/`abort` after the run."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, block: int = BLOCK_TOKENS):
        if capacity < block:
            raise ValueError(f"prefix cache needs at least one block of {block} tokens, got {capacity}")
        self.block, self.n_slots = block, capacity // block
        self.bytes_per_token = bytes_per_token(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                                               dtype=dtype)
        rows = self.n_slots * block
        # NOTE: zeros, not empty: the memory is committed now, so a pool too large fails at start.
        self.k = torch.zeros(layers, rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(layers, rows, kv_heads, head_dim, dtype=dtype, device=device)
        self._index: dict[tuple[int | bytes, bytes], _Block] = {}
        # (parent id, first k tokens) for k in 1..block-1 -> committed blocks starting so, oldest first
        self._prefixes: dict[tuple[int | bytes, bytes], dict[int, _Block]] = {}
        self._lru: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # oldest first
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._ids = itertools.count(1)  # 0 is the root
        self._lock = threading.RLock()
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
        blk = self.block
        matched = np.zeros(len(cu) - 1, dtype=np.int64)
        reads: list[np.ndarray] = []
        starts: list[int] = []  # original row of each pending block's first token, in lease.pending order
        empty = np.zeros(0, np.int64)
        lease = Lease(matched, empty, empty, empty, empty)
        pending: dict[tuple[int | bytes, bytes], _Block] = {}
        offsets = np.arange(blk, dtype=np.int64)
        with self._lock:
            for s in range(len(cu) - 1):
                a = int(cu[s])
                n_full = (int(cu[s + 1]) - a) // blk
                raw = ids[a:a + n_full * blk].tobytes()
                width = 4 * blk
                root: int | bytes = (namespaces[s] or 0) if namespaces is not None else 0
                parent: _Block | None = None
                chain: list[_Block] = []
                j = 0
                while j < n_full:
                    found = self._index.get((parent.id if parent else root, raw[j * width:(j + 1) * width]))
                    if found is None:
                        break
                    chain.append(found)
                    parent, j = found, j + 1
                # the last token is always computed, so a partial match needs at most n-1 tokens
                k_max = min(blk - 1, int(cu[s + 1]) - 1 - (a + j * blk))
                part, k = self._partial(parent, ids[a + j * blk:a + j * blk + max(k_max, 0)], root)
                pins = chain + [part] if part is not None else chain
                for b in pins:
                    b.refs += 1
                lease.pinned.extend(pins)
                self._touch(pins)
                matched[s] = j * blk + k
                if chain:
                    reads.append((np.array([b.slot for b in chain], np.int64)[:, None] * blk
                                  + offsets).ravel())
                if part is not None:
                    reads.append(part.slot * blk + offsets[:k])
                chained = True  # every complete block is cached or written (a tail may follow)
                for jj in range(j, n_full):
                    key = (parent.id if parent else root, raw[jj * width:(jj + 1) * width])
                    mine = pending.get(key)
                    if mine is None:
                        mine = self._new(parent, key[1], jj, a + jj * blk, pending, lease, starts, root)
                        if mine is None:
                            chained = False  # pool full of pinned or inner blocks: write nothing deeper
                            break
                    parent = mine
                tail = int(cu[s + 1]) - (a + n_full * blk)
                if chained and tail:
                    key = (parent.id if parent else root, ids[a + n_full * blk:int(cu[s + 1])].tobytes())
                    if key not in self._prefixes and key not in pending:  # not cached, not being written
                        self._new(parent, key[1], n_full, a + n_full * blk, pending, lease, starts, root)
        if reads:
            lease.read_rows = np.concatenate(reads)
        lease.write_starts = np.asarray(starts, dtype=np.int64)
        lease.write_slots = np.asarray([b.slot for b in lease.pending], dtype=np.int64)
        lease.write_lens = np.asarray([len(b.tokens) // 4 for b in lease.pending], dtype=np.int64)
        return lease

    def _new(self, parent, tokens: bytes, depth: int, start: int, pending: dict,
             lease: Lease, starts: list, root: int | bytes = 0) -> _Block | None:
        """A pending block of this lease (its tokens' rows from original row `start`); None if no slot."""
        slot = self._allocate()
        if slot is None:
            return None
        b = _Block(next(self._ids), parent, tokens, depth, slot, root=root if parent is None else 0)
        pending[b.key] = b
        lease.pending.append(b)
        starts.append(start)
        return b

    def _partial(self, parent: _Block | None, tail: np.ndarray,
                 root: int | bytes = 0) -> tuple[_Block | None, int]:
        """The committed child of `parent` (or first block of namespace `root`) sharing the longest
        run of leading tokens with `tail` (len(tail) < block), and that length; (None, 0) when none
        shares the first token."""
        pid, raw = (parent.id if parent else root), tail.tobytes()
        lo, hi = 0, len(tail)  # a child starts with tail[:lo]; none starts with tail[:hi+1]
        while lo < hi:  # prefixes present are closed under shortening: binary search
            mid = (lo + hi + 1) // 2
            if (pid, raw[:4 * mid]) in self._prefixes:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None, 0
        holders = self._prefixes[(pid, raw[:4 * lo])]
        return next(reversed(holders.values())), lo  # the newest: any holder has equal rows

    def _publish(self, b: _Block) -> None:
        self._index[b.key] = b
        self._lru[b.id] = b
        pid = b.key[0]
        for k in self._prefix_lengths(b):
            self._prefixes.setdefault((pid, b.tokens[:4 * k]), {})[b.id] = b
        if b.parent is not None:
            b.parent.children += 1

    def _prefix_lengths(self, b: _Block) -> range:
        """Leading-token counts the partial index holds `b` under: 1..block-1, or 1..t for a tail."""
        return range(1, min(self.block - 1, len(b.tokens) // 4) + 1)

    def _allocate(self) -> int | None:
        if self._free:
            return self._free.pop()
        for victim in self._lru.values():  # oldest first; parents are never older than children
            if victim.refs == 0 and victim.children == 0:
                self._drop(victim)
                self.evictions += 1
                return self._free.pop()
        return None

    def _drop(self, b: _Block) -> None:
        del self._index[b.key]
        del self._lru[b.id]
        pid = b.key[0]
        for k in self._prefix_lengths(b):
            key = (pid, b.tokens[:4 * k])
            holders = self._prefixes[key]
            del holders[b.id]
            if not holders:
                del self._prefixes[key]
        if b.parent is not None:
            b.parent.children -= 1
        self._free.append(b.slot)

    def _touch(self, blocks: list[_Block]) -> None:
        """Most recent use: deepest first, so every parent ends up more recent than its children."""
        for b in sorted(blocks, key=lambda x: -x.depth):
            if b.id in self._lru:
                self._lru.move_to_end(b.id)

    # -- settling (worker thread) ---------------------------------------------------------------
    def commit(self, lease: Lease) -> None:
        """The batch ran: publish its blocks (a block another batch published meanwhile wins)."""
        with self._lock:
            if lease.done:
                return
            lease.done = True
            same: dict[int, _Block] = {}  # pending id -> the committed block it duplicates
            touched = list(lease.pinned)
            for b in lease.pending:  # parents before children
                if b.parent is not None:
                    b.parent = same.get(b.parent.id, b.parent)
                existing = self._index.get(b.key)
                if existing is not None:
                    same[b.id] = existing
                    self._free.append(b.slot)
                    touched.append(existing)
                    continue
                self._publish(b)
                touched.append(b)
            self._touch(touched)
            for b in lease.pinned:
                b.refs -= 1
            self.hits += lease.hits
            self.misses += lease.misses

    def abort(self, lease: Lease) -> None:
        """The batch failed or was dropped: unpin, and free the rows it may have half written."""
        with self._lock:
            if lease.done:
                return
            lease.done = True
            for b in lease.pinned:
                b.refs -= 1
            self._free.extend(b.slot for b in lease.pending)

    def reset(self) -> None:
        """Forget every block and zero the counters (the warm-up's made-up prefixes leave no trace).

        Only with no lease open: every slot is then free or held by a committed block.
        """
        with self._lock:
            if len(self._free) + len(self._index) != self.n_slots or any(b.refs for b in self._index.values()):
                raise RuntimeError("the prefix cache cannot be reset while a batch holds a lease on it")
            self._index.clear()
            self._prefixes.clear()
            self._lru.clear()
            self._free = list(range(self.n_slots - 1, -1, -1))
            self.hits = self.misses = self.evictions = 0

"""The prefix cache's index against a brute-force model of the same rules, over random operations.

`_Reference` keeps every block in one dict and answers each question by scanning all of them: a
full look-up compares every live block's key, the partial look-up measures every child's shared
leading tokens, eviction takes the minimum over all evictable blocks, children are recounted. It
knows nothing of sorted siblings, linked eviction lists, pins shared within a lease or look-ups reused from
the previous sequence. After every plan its lease must equal the cache's (matched tokens, pool
rows read, blocks written and their slots), and after every step the committed blocks and the
eviction count must agree.

The policy both follow: a block is used when a batch that pinned it, published it or published a
duplicate of it settles (commit or abort; a look-up alone does not count, the block is pinned until
then). A settling uses its blocks one at a time: its published blocks (or the committed blocks they
duplicate) from the last planned back to the first, then the blocks it read from the last pinned
back to the first. Eviction takes the evictable block (committed, unpinned, childless) used least
recently. Of the children sharing the most leading tokens with a partial query, the cache reads
the smallest in int32 byte order that is not below the query, else the largest below it (any of
them holds the same rows for those tokens).
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.prefix_cache import PrefixCache
from models.prefix_cache.siblings import Siblings, longest, starts_with

BLK = 16


def _b(tokens) -> bytes:
    return np.asarray(tokens, dtype=np.int32).tobytes()


class _Reference:
    def __init__(self, n_slots: int) -> None:
        self.blocks: dict[int, dict] = {}  # id -> block (live or not)
        self.free = list(range(n_slots - 1, -1, -1))
        self.clock, self.next_id, self.evictions = 0, 1, 0
        self.queued: list[dict] = []

    def live(self):
        return [b for b in self.blocks.values() if b["live"]]

    def pkey(self, b):
        return ("id", b["parent"]) if b["parent"] is not None else ("root", b["root"])

    def children(self, b) -> int:
        return sum(1 for c in self.live() if c["parent"] == b["id"])

    def find(self, pk, tokens):
        hits = [b for b in self.live() if self.pkey(b) == pk and b["tokens"] == tuple(tokens)]
        assert len(hits) <= 1
        return hits[0] if hits else None

    def allocate(self):
        if self.free:
            return self.free.pop()
        evictable = [b for b in self.live() if b["refs"] == 0 and self.children(b) == 0]
        if not evictable:
            return None
        victim = min(evictable, key=lambda b: b["used"])
        victim["live"] = False
        self.evictions += 1
        return victim["slot"]

    def new(self, parent, root, tokens, depth, start, lease):
        slot = self.allocate()
        if slot is None:
            return None
        b = {"id": self.next_id, "parent": parent["id"] if parent else None, "root": root if parent is None else 0,
             "tokens": tuple(tokens), "depth": depth, "slot": slot, "refs": 0, "used": 0, "live": False}
        self.next_id += 1
        self.blocks[b["id"]] = b
        lease["pending"].append(b)
        lease["writes"].append((start, len(tokens), slot))
        return b

    def use(self, b):
        self.clock += 1
        b["used"] = self.clock

    def pin(self, b, lease):
        if all(p is not b for p in lease["pinned"]):
            b["refs"] += 1
            lease["pinned"].append(b)

    def plan(self, seqs, namespaces):
        for old in self.queued:
            self.commit(old)
        self.queued = []
        lease = {"pinned": [], "pending": [], "writes": [], "matched": [], "rows": [], "done": False}
        pending_keys: dict = {}
        offset = 0
        for s, seq in enumerate(seqs):
            root = (namespaces[s] or 0) if namespaces else 0
            parent, j, n_full = None, 0, len(seq) // BLK
            while j < n_full:
                pk = ("id", parent["id"]) if parent else ("root", root)
                found = self.find(pk, seq[j * BLK:(j + 1) * BLK])
                if found is None:
                    break
                self.pin(found, lease)
                lease["rows"] += [found["slot"] * BLK + i for i in range(BLK)]
                parent, j = found, j + 1
            pk = ("id", parent["id"]) if parent else ("root", root)
            query = seq[j * BLK:j * BLK + max(0, min(BLK - 1, len(seq) - 1 - j * BLK))]
            shared = {}
            for c in self.live():
                if self.pkey(c) == pk:
                    n = 0
                    while n < min(len(c["tokens"]), len(query)) and c["tokens"][n] == query[n]:
                        n += 1
                    shared[c["id"]] = n
            k = max(shared.values(), default=0)
            if k:
                holders = [self.blocks[i] for i, n in shared.items() if n == k]
                above = [c for c in holders if _b(c["tokens"]) >= _b(query)]
                part = (min(above, key=lambda c: _b(c["tokens"])) if above
                        else max(holders, key=lambda c: _b(c["tokens"])))
                self.pin(part, lease)
                lease["rows"] += [part["slot"] * BLK + i for i in range(k)]
            lease["matched"].append(j * BLK + k)
            chained = True
            for jj in range(j, n_full):
                key = (("id", parent["id"]) if parent else ("root", root), tuple(seq[jj * BLK:(jj + 1) * BLK]))
                mine = pending_keys.get(key)
                if mine is None:
                    mine = self.new(parent, root, key[1], jj, offset + jj * BLK, lease)
                    if mine is None:
                        chained = False
                        break
                    pending_keys[key] = mine
                parent = mine
            tail = seq[n_full * BLK:]
            if chained and tail:
                pk = ("id", parent["id"]) if parent else ("root", root)
                covered = any(self.pkey(c) == pk and c["tokens"][:len(tail)] == tuple(tail) for c in self.live())
                if (pk, tuple(tail)) not in pending_keys and not covered:
                    mine = self.new(parent, root, tail, n_full, offset + n_full * BLK, lease)
                    if mine is not None:
                        pending_keys[(pk, tuple(tail))] = mine
            offset += len(seq)
        return lease

    def commit(self, lease):
        if lease["done"]:
            return
        lease["done"] = True
        same: dict[int, int] = {}
        published = []
        for b in lease["pending"]:
            if b["parent"] in same:
                b["parent"] = same[b["parent"]]
            existing = self.find(self.pkey(b), b["tokens"])
            if existing is not None:
                same[b["id"]] = existing["id"]
                self.free.append(b["slot"])
                published.append(existing)
                continue
            b["live"] = True
            published.append(b)
        for b in published[::-1]:
            self.use(b)
        for b in lease["pinned"][::-1]:
            b["refs"] -= 1
            self.use(b)

    def abort(self, lease):
        if lease["done"]:
            return
        lease["done"] = True
        for b in lease["pinned"][::-1]:
            b["refs"] -= 1
            self.use(b)
        self.free.extend(b["slot"] for b in lease["pending"])


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


def _same_state(cache: PrefixCache, ref: _Reference) -> None:
    got = {(b.slot, b.tokens, b.parent.slot if b.parent else None, b.root) for b in cache._index.values()}
    want = {(b["slot"], _b(b["tokens"]), ref.blocks[b["parent"]]["slot"] if b["parent"] else None, b["root"])
            for b in ref.live()}
    assert got == want
    assert cache.evictions == ref.evictions


_token = st.sampled_from([3, 5, 7, 300, 70000, -2])  # small alphabet: many shared prefixes and ties
_run = st.tuples(_token, st.integers(1, 20))


@settings(max_examples=80, deadline=None)
@given(slots=st.integers(2, 9),
       steps=st.lists(st.tuples(
           st.lists(st.tuples(st.lists(_run, min_size=1, max_size=4), st.sampled_from([b"", b"", b"ns"])),
                    min_size=1, max_size=5),
           st.sampled_from(["commit", "abort", "hold", "later"])), min_size=1, max_size=10))
def test_leases_and_evictions_equal_the_brute_force_model(slots, steps):
    cache = PrefixCache(layers=1, kv_heads=1, head_dim=2, capacity=slots * BLK, dtype=torch.float32, device="cpu")
    ref = _Reference(slots)
    held: list = []
    for items, fate in steps:
        seqs = [[t for tok, n in runs for t in [tok] * n] for runs, _ in items]
        spaces = [ns for _, ns in items]
        namespaces = spaces if any(spaces) else None
        lease = cache.plan(*_pack(seqs), namespaces)
        want = ref.plan(seqs, namespaces)
        assert lease.matched.tolist() == want["matched"]
        assert lease.read_rows.tolist() == want["rows"]
        assert list(zip(lease.write_starts.tolist(), lease.write_lens.tolist(), lease.write_slots.tolist())) \
            == want["writes"]
        for old, old_ref in held:  # planned while the previous batch ran: it settles after
            cache.commit(old)
            ref.commit(old_ref)
        held = []
        if fate == "hold":
            held.append((lease, want))
        elif fate == "later":  # the worker's hand-over: published at the next plan
            cache.commit_later(lease)
            ref.queued.append(want)
        else:
            getattr(cache, fate)(lease)
            getattr(ref, fate)(want)
            _same_state(cache, ref)
    cache.stats()  # publishes what is queued
    for old, old_ref in held:
        cache.commit(old)
        ref.commit(old_ref)
    for q in ref.queued:
        ref.commit(q)
    _same_state(cache, ref)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([1, 2, 256, 65536, -1]), min_size=1, max_size=16), max_size=12),
       st.lists(st.sampled_from([1, 2, 256, 65536, -1]), min_size=1, max_size=15))
def test_siblings_find_the_longest_shared_run(children, query):
    sib = Siblings()
    kids = {_b(c) for c in children}
    for c in kids:
        sib.add(7, c)
    held = sib.get(7)  # one parent's kids: what a block holds for its own children
    best = 0
    for c in kids:
        n = 0
        while n < min(len(c), 4 * len(query)) // 4 and c[4 * n:4 * n + 4] == _b(query)[4 * n:4 * n + 4]:
            n += 1
        best = max(best, n)
    tokens, k = longest(held, _b(query))
    assert k == best
    assert (tokens is None) == (best == 0)
    if tokens is not None:
        assert tokens in kids and tokens[:4 * k] == _b(query)[:4 * k]
    assert starts_with(held, _b(query)) == any(c.startswith(_b(query)) for c in kids)
    assert longest(sib.get(8), _b(query)) == (None, 0)  # another parent's children are never seen
    for c in kids:
        sib.remove(7, c)
    assert sib.get(7) is None and not list(sib.items())

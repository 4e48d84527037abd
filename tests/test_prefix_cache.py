"""The prefix cache's block index on its own: sizes, exact keys, leases, LRU eviction.

Host-side only (a pool of 1 layer, 1 head, dim 2 on CPU); the forward's exactness with the cache
is tests/test_prefix_cache_exact.py. A random walk of plan/commit/abort checks the structural
invariants after every step against a reference recount.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.prefix_cache import PrefixCache, bytes_per_token, capacity_tokens
from models.prefix_cache.siblings import as_list

BLK = 16


def _cache(blocks: int) -> PrefixCache:
    return PrefixCache(layers=1, kv_heads=1, head_dim=2, capacity=blocks * BLK, dtype=torch.float32,
                       device="cpu")


def _pack(*seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


def _seq(first: int, n: int) -> list[int]:
    return [first] + list(range(1000, 1000 + n - 1))


def _check(cache: PrefixCache, live_pending: int = 0) -> None:
    """Committed chains are prefix-closed, counts agree, every slot is accounted for once."""
    committed = list(cache._index.values())
    ids = {b.id for b in committed}
    for b in committed:
        assert b.parent is None or b.parent.id in ids, "a committed block lost its parent"
        assert b.children == sum(1 for c in committed if c.parent is b)
        assert cache._index[b.key] is b
        assert len(b.tokens) == 4 * BLK or b.children == 0, "a tail block has children"
    slots = [b.slot for b in committed] + list(cache._free)
    assert len(slots) == len(set(slots)) and len(slots) + live_pending == cache.n_slots
    siblings = {}  # the partial-match index, recounted: each parent's children's tokens, sorted
    for b in committed:
        pid = b.parent.id if b.parent is not None else b.root
        siblings.setdefault(pid, []).append(b.tokens)
    held = {pid: list(v) for pid, v in cache._siblings.items()}  # the roots' kids, then each block's
    held.update((b.id, as_list(b.kids)) for b in committed if b.kids is not None)
    assert held == {k: sorted(v) for k, v in siblings.items()}
    # the eviction order holds exactly the unpinned committed blocks, each after its children,
    # so its oldest block is always a leaf
    order = cache._order.blocks()
    assert {b.id for b in order} == {b.id for b in committed if b.refs == 0} and len(order) == len(set(order))
    at = {b.id: i for i, b in enumerate(order)}
    for b in committed:
        if b.parent is not None:
            assert b.parent.refs >= b.refs, "a pinned block's parent is unpinned"
            if b.parent.refs == 0:
                assert at[b.id] < at[b.parent.id], "a parent would be evicted before its child"


def test_sizes():
    per = bytes_per_token(layers=28, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert per == 2 * 28 * 8 * 128 * 2
    assert capacity_tokens("512MiB", per) == (512 << 20) // per
    assert capacity_tokens("2GB", per) == 2 * 10**9 // per
    assert capacity_tokens("1.5 GiB", per) == int(1.5 * 2**30) // per
    assert capacity_tokens("8192tokens", per) == 8192
    assert capacity_tokens(" 0 ", per) == 0 and capacity_tokens(0, per) == 0
    assert capacity_tokens(4096, 1024) == 4
    assert capacity_tokens("auto", 64) == 65536  # tiny models: capped in tokens
    for bad in ("12 parsecs", "-5", "lots", "5 MiB tokens", ""):
        with pytest.raises(ValueError):
            capacity_tokens(bad, per)


def test_auto_sizes_by_the_machine_and_says_why():
    from models.prefix_cache.size import auto_device_tokens, auto_host_tokens

    per = bytes_per_token(layers=28, kv_heads=8, head_dim=128, dtype=torch.float32)  # Qwen3-0.6B on a CPU
    # CPU: a quarter of the available RAM, at most 4 GiB and 65,536 tokens.
    tokens, why = auto_host_tokens(per, 8 << 30)
    assert tokens == (2 << 30) // per and "25% of 8.00 GiB RAM available" in why
    assert auto_host_tokens(per, 64 << 30)[0] == (4 << 30) // per  # the byte cap
    assert auto_host_tokens(64, 64 << 30)[0] == 65536  # the token cap
    # CUDA: 70% of what is free after the largest batch's forward.
    per_bf16 = per // 2
    tokens, why = auto_device_tokens(per_bf16, 60 << 30, warmup_tokens=16384, peak=3 << 30)
    assert tokens == int((60 << 30) * 0.7) // per_bf16
    assert tokens > 300_000  # an 80 GB H100: hundreds of thousands of cached tokens, not 4,600
    assert "70% of 60.00 GiB device memory free after a 16384-token forward (peak allocated 3.00 GiB)" in why


def test_lookup_is_exact_and_sees_committed_blocks_only():
    cache = _cache(8)
    a = _seq(1, 40)
    lease = cache.plan(*_pack(a))
    # two full blocks and the 8-token tail
    assert lease.matched.tolist() == [0] and lease.write_lens.tolist() == [BLK, BLK, 8]
    twin = cache.plan(*_pack(a))
    assert twin.matched.tolist() == [0]  # pending rows are invisible
    cache.abort(twin)
    cache.commit(lease)
    again = cache.plan(*_pack(a, a[:20], _seq(2, 40)))
    # a: both blocks and 7 rows of its tail (its last token is always computed); a[:20]: block 1
    # and then 3 of the second block's rows
    assert again.matched.tolist() == [39, 19, 0]
    slots = [b.slot for b in lease.pending]
    want = np.concatenate([np.arange(BLK) + s * BLK for s in slots[:2]])
    tail = np.arange(7) + slots[2] * BLK
    assert again.read_rows.tolist() == want.tolist() + tail.tolist() + want[:19].tolist()
    # the same second block after a different first block is another prefix: no match
    other = _seq(2, 40)
    other[16:32] = a[16:32]
    miss = cache.plan(*_pack(other))
    assert miss.matched.tolist() == [0]
    cache.abort(miss)
    cache.abort(again)
    _check(cache)


def _full_prefix(b) -> list[int]:
    """The tokens from position 0 to the end of block b."""
    out = []
    while b is not None:
        out = np.frombuffer(b.tokens, dtype=np.int32).tolist() + out
        b = b.parent
    return out


def _check_reads(cache: PrefixCache, lease, seqs) -> None:
    """Every row a lease reads belongs to a block whose tokens up to that row are the reader's."""
    by_slot = {b.slot: b for b in lease.pinned}
    at = 0
    for seq, m in zip(seqs, lease.matched.tolist()):
        assert m <= max(len(seq) - 1, (len(seq) // BLK) * BLK)
        for d in range(m):
            row = int(lease.read_rows[at + d])
            b = by_slot[row // BLK]
            assert cache._index.get(b.key) is b  # committed, and pinned by this lease
            assert row % BLK == d % BLK and _full_prefix(b)[:d + 1] == seq[:d + 1]
        at += m
    assert at == len(lease.read_rows)


def test_partial_blocks_match_their_leading_tokens():
    cache = _cache(64)
    head = list(range(2000, 2020))  # a 20-token instruction: one full block and 4 tokens
    first = head + list(range(3000, 3020))
    cache.commit(cache.plan(*_pack(first)))
    second = head + list(range(4000, 4012))  # a different query after the same instruction
    lease = cache.plan(*_pack(second))
    assert lease.matched.tolist() == [20]
    _check_reads(cache, lease, [second])
    pinned = lease.pinned[-1]
    assert pinned.refs == 1 and pinned.depth == 1  # the partly read block is pinned like a full one
    # its own second block is complete and not cached: written (rows 16..19 copied from the pool)
    assert lease.write_starts.tolist() == [16]
    cache.commit(lease)
    assert pinned.refs == 0
    # many siblings under one parent (every query after one template): still the exact longest run
    for q in range(40):
        cache.commit(cache.plan(*_pack(head + [5000 + q] * 12)))
    probe = head + [5007] * 3 + [1]
    lease = cache.plan(*_pack(probe, head + [5007] * 9 + [7] * 3, head + [9] * 12))
    assert lease.matched.tolist() == [23, 29, 20]  # 20+3 (last token computed), 20+9, 20
    _check_reads(cache, lease, [probe, head + [5007] * 9 + [7] * 3, head + [9] * 12])
    cache.abort(lease)
    # the first token decides nothing: same first token, different second token matches 1 row
    lease = cache.plan(*_pack(head[:16] + [2016, 1, 1, 1, 1]))
    assert lease.matched.tolist() == [17]
    cache.abort(lease)
    _check(cache)


def test_duplicate_writes_dedupe_within_and_across_batches():
    cache = _cache(8)
    a = _seq(1, 33)
    l1 = cache.plan(*_pack(a, a))  # the same blocks (two full, a 1-token tail) twice: written once
    assert l1.write_lens.tolist() == [BLK, BLK, 1]
    l2 = cache.plan(*_pack(a))  # a second batch in flight writes its own copy
    assert len(l2.write_slots) == 3
    cache.commit(l1)
    cache.commit(l2)  # its copies lose to the published blocks and are freed
    assert cache.stats()["blocks"] == 3 and cache.bytes_in_use == 3 * BLK * cache.bytes_per_token
    _check(cache)


def test_abort_frees_pending_and_unpins():
    cache = _cache(4)
    base = cache.plan(*_pack(_seq(1, 32)))
    cache.commit(base)
    lease = cache.plan(*_pack(_seq(1, 64)))
    assert lease.matched.tolist() == [32] and all(b.refs == 1 for b in lease.pinned)
    cache.abort(lease)
    cache.abort(lease)  # idempotent
    assert all(b.refs == 0 for b in lease.pinned)
    assert cache.stats()["blocks"] == 2 and cache.bytes_in_use == 2 * BLK * cache.bytes_per_token
    _check(cache)


def test_lru_evicts_leaves_first_and_never_pinned_blocks():
    cache = _cache(4)
    x, y = _seq(1, 48), _seq(2, 32)
    cache.commit(cache.plan(*_pack(x)))  # x1 x2 x3
    cache.commit(cache.plan(*_pack(y)))  # y1 in the free slot, y2 evicts x3 (the oldest leaf)
    assert cache.evictions == 1
    lease = cache.plan(*_pack(x))  # pins x1 x2; rewriting x3 must evict y2, not x2 or x1
    assert lease.matched.tolist() == [32] and len(lease.write_slots) == 1
    assert cache.evictions == 2
    # y1 pinned too: every block is pinned or pending, so y2 gets no slot and nothing breaks
    blocked = cache.plan(*_pack(y))
    assert blocked.matched.tolist() == [16] and len(blocked.write_slots) == 0
    assert cache.evictions == 2
    cache.commit(lease)
    cache.commit(blocked)
    check = cache.plan(*_pack(x, y))
    assert check.matched.tolist() == [48, 16]
    cache.abort(check)
    _check(cache)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 20)),
                                            min_size=1, max_size=5),
                                   min_size=1, max_size=3),
                          st.sampled_from(["commit", "abort", "hold"])), min_size=1, max_size=12))
def test_random_walk_keeps_the_invariants(steps):
    """Runs of 3 token kinds ending anywhere in a block; leases settle now or one step later."""
    cache = _cache(5)
    held = []
    for runs, fate in steps:
        seqs = [[t for k, n in rs for t in [k] * n] + [9] for rs in runs]
        lease = cache.plan(*_pack(*seqs))
        _check_reads(cache, lease, seqs)
        for old in held:  # a batch planned while the previous one ran settles after it
            cache.commit(old)
        held = []
        if fate == "hold":
            held.append(lease)
        else:
            getattr(cache, fate)(lease)
        _check(cache, live_pending=sum(len(h.pending) for h in held))


def test_server_flag_and_environment():
    from server.cli import parse_config
    from server.config import ServerConfig

    assert ServerConfig().prefix_cache_size == "auto"
    assert parse_config(["--prefix-cache-size", "8192tokens"], environ={}).prefix_cache_size == "8192tokens"
    assert parse_config([], environ={"PREFIX_CACHE_SIZE": "0"}).prefix_cache_size == "0"
    with pytest.raises(ValueError):
        ServerConfig(prefix_cache_size="a lot")


def test_tails_are_written_once_read_partially_and_stay_leaves():
    cache = _cache(16)
    head = list(range(2000, 2020))  # a 20-token instruction: one full block and a 4-token tail
    first = head + list(range(3000, 3006))  # 26 tokens: block 0 and a 10-token tail
    lease = cache.plan(*_pack(first))
    assert lease.write_lens.tolist() == [BLK, 10] and lease.write_starts.tolist() == [0, BLK]
    cache.commit(lease)
    tail = lease.pending[1]
    assert len(tail.tokens) == 4 * 10 and tail.parent is lease.pending[0]
    second = head + list(range(4000, 4006))  # the next query reads the instruction to its end
    lease = cache.plan(*_pack(second))
    assert lease.matched.tolist() == [20]
    _check_reads(cache, lease, [second])
    assert lease.write_lens.tolist() == [10]  # its own tail (shares only 4 tokens with the cached one)
    cache.commit(lease)
    # a tail that a committed block already starts with is not written again
    lease = cache.plan(*_pack(first[:23]))
    assert lease.matched.tolist() == [22] and lease.write_lens.tolist() == []
    cache.commit(lease)
    # a longer input completes that block: a new full block under block 0, the tail stays a leaf
    longer = first + list(range(5000, 5010))
    lease = cache.plan(*_pack(longer))
    assert lease.matched.tolist() == [26] and lease.write_lens.tolist() == [BLK, 4]
    assert lease.pending[0].parent is tail.parent and tail.children == 0
    cache.commit(lease)
    _check(cache)


def test_commit_later_publishes_at_the_next_plan_and_ignores_a_late_abort():
    """The worker only queues a finished lease; the next plan publishes it before its look-up."""
    cache = _cache(8)
    seq = _seq(1, 40)
    lease = cache.plan(*_pack(seq))
    cache.commit_later(lease)
    assert not cache._index and not lease.done  # nothing published on the worker's call
    cache.abort(lease)  # a dropped batch's finalizer after the hand-over: the commit stands
    again = cache.plan(*_pack(seq))
    assert lease.done and again.matched.tolist() == [39]  # published first, then looked up
    assert len(cache._index) == 3  # 2 blocks and the 8-token tail
    cache.commit_later(again)
    assert cache.stats()["blocks"] == 3 and again.done  # stats publishes what is queued too
    cache.reset()
    _check(cache)


def test_a_cpu_pool_larger_than_the_ram_available_is_refused_at_start(monkeypatch):
    # the CPU pool's pages are not touched at allocation, so the size is checked against the RAM
    import models.prefix_setup as setup

    monkeypatch.setattr(setup, "available_host_bytes", lambda: 1 << 30)
    with pytest.raises(ValueError, match="more than the 1.00 GiB of RAM available"):
        setup.check_host_pool(2 << 30, device=torch.device("cpu"), size="2GiB")
    setup.check_host_pool(512 << 20, device=torch.device("cpu"), size="512MiB")  # fits
    setup.check_host_pool(2 << 30, device=torch.device("meta"), size="2GiB")  # not a CPU pool

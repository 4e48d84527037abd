"""Batch formation: FIFO, and the prefix-aware policy's choices on hand-built and random queues.

Checked: light load is exactly FIFO; budgets and request atomicity always hold; grouping by
shared prefix (one query's requests per batch); aging by time and by skips; no starvation under
a constant inflow; better compression than FIFO (measured with models.trie.build_index); the
former's own state (skips, keys) kept only for requests still waiting.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.trie import build_index, positions_from_cu_seqlens
from scheduler.forming import Entry, PrefixPolicy, form_batch_fifo
from scheduler.policy import make_former
from scheduler.prefix_forming import PrefixFormer

SYSTEM = list(range(1000, 1040))  # the template prefix every request shares (40 tokens)
# Grouping mechanics in isolation: no aging, and any gain over FIFO is worth a reorder.
NO_AGING = PrefixPolicy(max_wait_s=math.inf, max_skips=10**9, min_gain=0.0)


def query(q: int) -> list[int]:
    return [5000 + 10 * q + j for j in range(10)]


def request(rid: int, q: int, n_items: int, rng: random.Random, *, arrival: float = 0.0) -> list[Entry]:
    """A rerank-like request: SYSTEM + one query + a random passage per item (70 tokens each)."""
    return [
        Entry(rid, SYSTEM + query(q) + [rng.randrange(20000, 30000) for _ in range(20)], arrival)
        for _ in range(n_items)
    ]


def queue_of(query_per_request: list[int], *, n_items: int = 2, seed: int = 0) -> list[Entry]:
    rng = random.Random(seed)
    out: list[Entry] = []
    for rid, q in enumerate(query_per_request):
        out += request(rid, q, n_items, rng, arrival=rid * 1e-3)
    return out


def query_of(e: Entry) -> int:
    return (e.input_ids[len(SYSTEM)] - 5000) // 10


def compact_and_total(batch: list[Entry]) -> tuple[int, int]:
    """(N', N) of a batch, from the trie builder itself."""
    lens = np.array([e.n_tokens for e in batch])
    cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    ids = np.array([t for e in batch for t in e.input_ids], dtype=np.int32)
    index = build_index(ids, positions_from_cu_seqlens(cu), cu)
    return len(index.compact_ids), int(cu[-1])


def prefix(waiting, *, max_tokens, max_requests=None, now=0.0, config=NO_AGING, skips=None, former=None):
    """One formation by a fresh former (or ``former``), with ``skips`` per request id preset."""
    former = former or PrefixFormer(max_tokens=max_tokens, max_requests=max_requests, config=config)
    former.skips.update(skips or {})
    return former(waiting, now)


# -- random queues -------------------------------------------------------------------------------
@st.composite
def queues(draw):
    """Requests of 1-4 items over a tiny alphabet (so prefixes collide), random ages and skips."""
    n_req = draw(st.integers(1, 12))
    waiting: list[Entry] = []
    skips: dict[int, int] = {}
    for rid in range(n_req):
        arrival = draw(st.floats(0.0, 2.0))
        skips[rid] = draw(st.integers(0, 5))
        for _ in range(draw(st.integers(1, 4))):
            ids = draw(st.lists(st.integers(0, 3), min_size=1, max_size=12))
            waiting.append(Entry(rid, ids, arrival))
    waiting.sort(key=lambda e: e.arrival)  # arrival order; sort is stable, requests stay contiguous
    return waiting, skips


def check_batch(waiting: list[Entry], chosen: list[int], *, max_tokens: int, max_requests: int | None):
    assert chosen, "a non-empty queue must give a non-empty batch"
    assert chosen == sorted(set(chosen))
    cap = max_requests if max_requests is not None else len(waiting)
    assert len(chosen) <= cap
    assert sum(waiting[i].n_tokens for i in chosen) <= max_tokens
    by_request: dict[int, list[int]] = {}
    for i, e in enumerate(waiting):
        by_request.setdefault(e.request_id, []).append(i)
    for rid, idx in by_request.items():
        inside = [i for i in idx if i in set(chosen)]
        if inside and inside != idx:  # split: only a request too big for any batch, alone, in order
            assert inside == idx[: len(inside)]
            assert len(inside) == len(chosen)
            assert sum(waiting[i].n_tokens for i in idx) > max_tokens or len(idx) > cap


@settings(max_examples=100, deadline=None)
@given(queues(), st.integers(0, 40), st.one_of(st.none(), st.integers(0, 10)), st.floats(0.0, 3.0))
def test_light_load_is_exactly_fifo(queue, slack, extra_requests, now):
    waiting, skips = queue
    total = sum(e.n_tokens for e in waiting)
    max_requests = None if extra_requests is None else len(waiting) + extra_requests
    former = PrefixFormer(max_tokens=total + slack, max_requests=max_requests)
    got = prefix(waiting, max_tokens=total + slack, now=now, skips=skips, former=former)
    assert got == form_batch_fifo(waiting, max_tokens=total + slack, max_requests=max_requests)
    assert former.skips == skips  # nothing was passed over


@settings(max_examples=120, deadline=None)
@given(queues(), st.data())
def test_budget_and_atomicity_always_hold(queue, data):
    waiting, skips = queue
    longest = max(e.n_tokens for e in waiting)
    max_tokens = data.draw(st.integers(longest, longest + 40))
    max_requests = data.draw(st.one_of(st.none(), st.integers(1, 8)))
    config = PrefixPolicy(max_wait_s=data.draw(st.floats(0.1, 3.0)), max_skips=data.draw(st.integers(0, 6)))
    now = data.draw(st.floats(0.0, 3.0))
    chosen = prefix(waiting, max_tokens=max_tokens, max_requests=max_requests, now=now, config=config, skips=skips)
    check_batch(waiting, chosen, max_tokens=max_tokens, max_requests=max_requests)


# -- hand-built queues ---------------------------------------------------------------------------
def test_fifo_dispatch_and_unknown_policy():
    waiting = queue_of([0, 1, 2, 0, 1, 2])
    assert make_former("fifo", max_tokens=300)(waiting, 0.0) == form_batch_fifo(waiting, max_tokens=300)
    assert isinstance(make_former("prefix", max_tokens=300), PrefixFormer)
    with pytest.raises(ValueError):
        make_former("lifo", max_tokens=300)
    with pytest.raises(ValueError):
        PrefixPolicy(depth=0)


@pytest.mark.parametrize("max_requests", [None, 6])
def test_groups_one_query_per_batch(max_requests):
    waiting = queue_of([0, 1, 2] * 3)  # interleaved: 9 requests of 2 items, 140 tokens each
    group = 3 * 2 * 70
    fifo = [waiting[i] for i in form_batch_fifo(waiting, max_tokens=group, max_requests=max_requests)]
    assert len({query_of(e) for e in fifo}) == 3  # FIFO mixes the queries
    chosen = prefix(waiting, max_tokens=group, max_requests=max_requests)
    batch = [waiting[i] for i in chosen]
    assert len(batch) == 6 and len({query_of(e) for e in batch}) == 1
    n_compact, n = compact_and_total(batch)
    n_compact_fifo, n_fifo = compact_and_total(fifo)
    assert n == n_fifo and n_compact < n_compact_fifo


def test_small_gain_keeps_fifo_large_gain_groups():
    waiting = queue_of([0, 1, 2] * 3)  # 10-token queries: grouping saves only a few percent
    group = 3 * 2 * 70
    fifo = form_batch_fifo(waiting, max_tokens=group)
    picky = PrefixPolicy(max_wait_s=math.inf, max_skips=10**9, min_gain=0.5)
    assert prefix(waiting, max_tokens=group, config=picky) == fifo
    assert prefix(waiting, max_tokens=group) != fifo  # min_gain 0: any gain regroups

    # 80-token queries: one query per batch saves far more than the default 10% over FIFO.
    rng = random.Random(1)
    long_q = {q: [7000 + 1000 * q + j for j in range(80)] for q in range(3)}
    waiting = [
        Entry(rid, SYSTEM + long_q[q] + [rng.randrange(20000, 30000) for _ in range(20)], rid * 1e-3)
        for rid, q in enumerate([0, 1, 2] * 3) for _ in range(2)
    ]
    per_request = 2 * (len(SYSTEM) + 80 + 20)
    aging_only = PrefixPolicy(max_wait_s=math.inf, max_skips=10**9)  # default min_gain
    chosen = prefix(waiting, max_tokens=3 * per_request, config=aging_only)
    assert {e.input_ids[len(SYSTEM)] for e in (waiting[i] for i in chosen)} == {long_q[0][0]}


def test_group_extends_to_the_nearest_prefix():
    # `near` shares the system prompt and 5 query tokens with query 0; query 2 only the system prompt
    waiting = queue_of([2, 0, 2, 0, 2, 0], n_items=1)
    waiting.append(Entry(99, SYSTEM + query(0)[:5] + [7] * 25, 1.0))
    chosen = prefix(waiting, max_tokens=4 * 70)
    assert chosen == [1, 3, 5, 6]


def test_atomic_requests_are_never_split_to_fill_a_batch():
    # popular group (query 0) fills 420 of 450 tokens; a 2-item query-0 request (140) cannot fit
    waiting = queue_of([0, 1, 0, 1, 0, 1, 0])
    chosen = prefix(waiting, max_tokens=450)
    check_batch(waiting, chosen, max_tokens=450, max_requests=None)
    assert len(chosen) == 6


def test_oversized_request_is_split_only_when_first():
    rng = random.Random(2)
    small = request(0, 0, 1, rng)
    big = request(1, 1, 5, rng)  # 350 tokens > budget 200
    waiting = big + small
    assert prefix(waiting, max_tokens=200) == [0, 1]  # at the head: split in order, like FIFO
    waiting = small + big + request(2, 0, 1, rng)
    chosen = prefix(waiting, max_tokens=200)
    assert chosen == [0, 6]  # not first: never split into a batch with others
    # request 1 passed over often enough: now urgent and the oldest urgent one, so split, alone
    config = PrefixPolicy(max_wait_s=math.inf, max_skips=5, min_gain=0.0)
    assert prefix(waiting, max_tokens=200, config=config, skips={1: 10**9}) == [1, 2]


@pytest.mark.parametrize("by", ["time", "skips"])
def test_aging_takes_the_old_entry_first(by):
    rng = random.Random(3)
    odd = request(0, 7, 1, rng, arrival=0.9)
    popular = [e for rid in range(1, 7) for e in request(rid, 0, 1, rng, arrival=1.0)]
    waiting = odd + popular
    config = PrefixPolicy(max_wait_s=0.5, max_skips=3, min_gain=0.0)
    budget = 6 * 70
    former = PrefixFormer(max_tokens=budget, config=config)
    fresh = former(waiting, 1.2)
    assert 0 not in fresh and former.skips[0] == 1  # grouping passed it over once
    if by == "time":
        chosen = former(waiting, 1.45)  # odd: 0.55 s old
    else:
        former.skips[0] = 3
        chosen = former(waiting, 1.2)
    assert chosen[0] == 0 and len(chosen) == 6


def test_skips_counted_only_for_requests_passed_over():
    waiting = queue_of([1, 0, 0, 0, 2])  # requests 0 and 4 are odd ones out
    former = PrefixFormer(max_tokens=420, config=NO_AGING)
    assert former(waiting, 0.0) == [2, 3, 4, 5, 6, 7]
    assert former.skips == {0: 1}


@pytest.mark.parametrize("lookahead", [1, 2, 8])
def test_lookahead_bounds_how_far_the_former_looks(lookahead):
    waiting = queue_of([1, 2, 3, 0, 0, 0])  # the group of query 0 sits past one batch's worth
    config = PrefixPolicy(max_wait_s=math.inf, max_skips=10**9, lookahead_batches=lookahead, min_gain=0.0)
    chosen = prefix(waiting, max_tokens=420, config=config)
    assert chosen == (list(range(6)) if lookahead == 1 else list(range(6, 12)))


def test_no_sharing_falls_back_to_fifo():
    rng = random.Random(4)
    waiting = [Entry(r, [rng.randrange(1, 10**5) for _ in range(50)], 0.0) for r in range(20)]
    former = PrefixFormer(max_tokens=400, config=NO_AGING)
    assert former(waiting, 0.0) == form_batch_fifo(waiting, max_tokens=400)
    assert former.skips == {}


def simulate(config: PrefixPolicy, *, steps: int, dt: float) -> int | None:
    """Batches until the oldest (odd) request is served, two popular queries arriving faster than served."""
    rng = random.Random(5)
    rid = 0
    waiting: list[Entry] = []
    former = PrefixFormer(max_tokens=3 * 140, config=config)

    def arrive(t: float, q: int) -> None:
        nonlocal rid
        waiting.extend(request(rid, q, 2, rng, arrival=t))
        rid += 1

    odd_rid = rid
    arrive(0.0, 9)
    for j in range(6):
        arrive(0.0, j % 2)
    for step in range(steps):
        now = step * dt
        for j in range(4):  # 4 requests in, 3 out per batch: the queue only grows
            arrive(now, j % 2)
        chosen = former(waiting, now)
        check_batch(waiting, chosen, max_tokens=3 * 140, max_requests=None)
        if any(waiting[i].request_id == odd_rid for i in chosen):
            return step + 1
        picked = set(chosen)
        waiting[:] = [e for i, e in enumerate(waiting) if i not in picked]
    return None


def test_no_starvation_under_constant_inflow():
    assert simulate(NO_AGING, steps=30, dt=0.1) is None  # grouping alone would starve it
    # passed over at most max_skips times, then first
    assert simulate(PrefixPolicy(max_wait_s=math.inf, max_skips=3, min_gain=0.0), steps=30, dt=0.1) <= 3 + 1
    # the first batch formed at or after arrival + max_wait_s (batches at now = 0, 0.1, ...) takes it
    assert simulate(PrefixPolicy(max_wait_s=0.45, max_skips=10**9, min_gain=0.0), steps=30, dt=0.1) <= math.ceil(0.45 / 0.1) + 1


def drain(waiting: list[Entry], policy: str, *, max_tokens: int) -> tuple[int, int]:
    waiting = list(waiting)
    n_compact = n_total = 0
    # 10-token queries gain little per regroup: min_gain 0 lets the default aging decide.
    former = make_former(policy, max_tokens=max_tokens, prefix=PrefixPolicy(min_gain=0.0))
    while waiting:
        chosen = former(waiting, 0.0)
        c, n = compact_and_total([waiting[i] for i in chosen])
        n_compact, n_total = n_compact + c, n_total + n
        picked = set(chosen)
        waiting = [e for i, e in enumerate(waiting) if i not in picked]
    return n_compact, n_total


def test_prefix_policy_compresses_better_than_fifo():
    queries = [q for q in range(12) for _ in range(4)]  # 12 queries, 4 requests each, shuffled
    random.Random(6).shuffle(queries)
    waiting = queue_of(queries, n_items=4, seed=7)
    c_fifo, n_fifo = drain(waiting, "fifo", max_tokens=4 * 4 * 70)
    c_prefix, n_prefix = drain(waiting, "prefix", max_tokens=4 * 4 * 70)
    assert n_fifo == n_prefix == sum(e.n_tokens for e in waiting)
    assert c_prefix / n_prefix < c_fifo / n_fifo


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=9), min_size=1, max_size=12),
    depth=st.integers(1, 6),
)
def test_prefix_keys_sort_and_lcp_match_python(seqs, depth):
    """The batched key builder orders requests like Python's tuple order of their first ``depth``
    tokens (a proper prefix first) and reports the true adjacent LCPs."""
    from scheduler.prefix_forming import _build_keys, _sorted_keys

    heads = [Entry(r, list(s), 0.0) for r, s in enumerate(seqs)]
    order, lcp = _sorted_keys(_build_keys(heads, depth), depth)
    cut = [tuple(s[:depth]) for s in seqs]
    assert [cut[i] for i in order.tolist()] == sorted(cut)
    assert order.tolist() == sorted(range(len(seqs)), key=lambda i: cut[i])  # stable
    sorted_cut = sorted(cut)
    expected = [
        next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(sorted_cut, sorted_cut[1:])
    ]
    assert lcp.tolist() == expected


def test_former_state_is_kept_only_for_waiting_requests():
    waiting = queue_of([1, 0, 0, 0, 2])  # request 0 is passed over, requests 1-3 taken
    former = PrefixFormer(max_tokens=420, config=NO_AGING)
    chosen = former(waiting, 0.0)
    assert former.skips == {0: 1} and set(former._keys) == {0, 1, 2, 3, 4}
    left = [e for i, e in enumerate(waiting) if i not in set(chosen)]
    assert {e.request_id for e in left} == {0, 4}
    former(left, 0.0)  # everything left fits: FIFO, and the taken requests are forgotten
    assert set(former._keys) <= {0, 4} and set(former.skips) <= {0, 4}
    former([Entry(9, [1], 0.0)], 0.0)  # requests 0 and 4 left too
    assert former.skips == {} and set(former._keys) <= {9}


@pytest.mark.parametrize("policy, max_requests", [("fifo", None), ("prefix", 100_000)])
def test_no_batch_holds_more_items_than_a_cuda_grid_dimension(policy, max_requests):
    """70,000 one-token items under a budget that admits them all: a batch stops at 65,535."""
    from scheduler.policy import MAX_BATCH_ITEMS

    assert MAX_BATCH_ITEMS == 2**16 - 1
    waiting = [Entry(i, [7 + i % 50], i * 1e-6) for i in range(70_000)]  # one request per item
    former = make_former(policy, max_tokens=1_000_000, max_requests=max_requests, prefix=NO_AGING)
    chosen = former(waiting, 1.0)
    assert len(chosen) == MAX_BATCH_ITEMS
    picked = set(chosen)
    rest = [e for i, e in enumerate(waiting) if i not in picked]
    assert len(former(rest, 1.0)) == 70_000 - MAX_BATCH_ITEMS

"""Prefix-aware batch formation: put requests that share token prefixes in one batch.

RadixMLP only dedupes what one batch holds. When more than a batch waits, this former looks at
each request's leading ``depth`` tokens (its first item's) and sorts the requests by them:
lexicographic order is a trie walk in disguise, since a set of sorted keys has
sum(len) - sum(adjacent LCP) distinct prefix nodes. So the tokens a run of sorted requests shares
(the cost model: tokens saved = sum over trie nodes of occurrences - 1) is the sum of the adjacent
LCPs inside it, and the LCP of two sorted keys is the minimum of the adjacent LCPs between them.
The batch is the budget-sized run that saves the most, grown by its nearest neighbours in the
trie while budget is left; it is kept only if it saves more than the FIFO batch would.

Invariants: requests stay atomic (one larger than the budget is split, in order, only when it
comes first); the token and item budgets always hold; when everything waiting fits in one batch
the result is exactly ``form_batch_fifo``'s; a request older than ``max_wait_s`` or passed over
``max_skips`` times is taken before any grouping, oldest first, so nothing starves. Cost: one
Python sort of R byte strings plus O(R * depth) numpy, for the R requests within the oldest
``lookahead_batches`` batches' worth of the queue, plus O(queue) to prune its state; the former
owns that state (skips and sort keys per request id, the key of a request's first waiting item),
keeps it only for requests still waiting, and runs on a snapshot outside the queue's lock.
"""
from __future__ import annotations

import heapq
import itertools
import time
from operator import attrgetter
from typing import Sequence

import numpy as np

from .forming import Entry, PrefixPolicy, form_batch_fifo

# NOTE: map(attrgetter) over thousands of entries costs a fraction of a generator's time.
_REQUEST_ID, _INPUT_IDS, _ARRIVAL = attrgetter("request_id"), attrgetter("input_ids"), attrgetter("arrival")


class PrefixFormer:
    """The "prefix" former: ``former(waiting, now)`` -> ascending indices of the next batch.

    NOTE: it counts a skip for every request passed over (some later request was chosen
    instead), so call it once per batch formed and take what it returns.
    """

    def __init__(self, *, max_tokens: int, max_requests: int | None = None,
                 config: PrefixPolicy = PrefixPolicy()) -> None:
        self.max_tokens, self.max_requests, self.config = max_tokens, max_requests, config
        self.skips: dict[int, int] = {}  # request id -> batches formed that passed it over
        self._keys: dict[int, tuple[bytes, int]] = {}  # request id -> sort key (see _build_keys)

    def __call__(self, waiting: Sequence[Entry], now: float | None = None) -> list[int]:
        self._prune(waiting)
        now = time.monotonic() if now is None else now
        return _form(waiting, self, max_tokens=self.max_tokens, max_requests=self.max_requests, now=now)

    def _prune(self, waiting: Sequence[Entry]) -> None:
        """Forget the requests that left the queue (taken or cancelled)."""
        if not self.skips and not self._keys:
            return
        live = set(map(_REQUEST_ID, waiting))
        for state in (self.skips, self._keys):
            for rid in [r for r in state if r not in live]:
                del state[rid]

    def keys(self, heads: list[Entry]) -> list[tuple[bytes, int]]:
        """Sort keys of the requests whose head entries are ``heads``, built once per request."""
        missing = [h for h in heads if h.request_id not in self._keys]
        if missing:
            self._keys.update(zip(map(_REQUEST_ID, missing), _build_keys(missing, self.config.depth)))
        return [self._keys[h.request_id] for h in heads]

    def count_skips(self, heads: list[Entry], picked: set[int], last: int) -> None:
        """Every request older than the newest one picked and not picked itself was passed over."""
        for r in range(last):
            if r not in picked:
                rid = heads[r].request_id
                self.skips[rid] = self.skips.get(rid, 0) + 1


def _form(waiting: Sequence[Entry], state: PrefixFormer, *, max_tokens: int, max_requests: int | None,
          now: float) -> list[int]:
    """Ascending indices into ``waiting`` of the next batch (see the module docstring)."""
    config = state.config
    n = len(waiting)
    fifo = form_batch_fifo(waiting, max_tokens=max_tokens, max_requests=max_requests)
    if len(fifo) == n:
        return fifo  # light load: everything fits, exactly FIFO
    cap = max_requests if max_requests is not None else n
    span = config.lookahead_batches
    waiting = _lookahead(waiting, max_tokens=span * max_tokens, max_items=span * cap)
    n = len(waiting)
    starts, tokens = _requests(waiting)
    items = np.diff(starts)
    if tokens[0] > max_tokens or items[0] > cap:
        return fifo  # the head is split in order anyway: it fills the batch alone
    heads = list(waiting) if len(items) == n else [waiting[s] for s in starts[:-1].tolist()]
    skips = np.fromiter((state.skips.get(h.request_id, 0) for h in heads), dtype=np.int64, count=len(heads))
    age = now - np.fromiter(map(_ARRIVAL, heads), dtype=np.float64, count=len(heads))
    urgent = np.flatnonzero((skips >= config.max_skips) | (age >= config.max_wait_s)).tolist()
    tokens_left, items_left = max_tokens, cap
    chosen: list[int] = []  # request indices (arrival order)
    for r in urgent:  # oldest first, like FIFO: the first that does not fit closes this phase
        if tokens[r] <= tokens_left and items[r] <= items_left:
            chosen.append(r)
            tokens_left -= int(tokens[r])
            items_left -= int(items[r])
        elif not chosen:  # the oldest urgent request is larger than a batch: split it in order
            s, e = int(starts[r]), int(starts[r + 1])
            part = form_batch_fifo(waiting[s:e], max_tokens=max_tokens, max_requests=max_requests)
            state.count_skips(heads, set(), r)
            return [s + i for i in part]
        else:
            break

    order, lcp = _sorted_keys(state.keys(heads), config.depth)  # [R] request of each sorted slot, [R-1]
    rank = np.empty(len(heads), dtype=np.int64)
    rank[order] = np.arange(len(heads))
    tok_s, cnt_s = tokens[order], items[order]
    taken = np.zeros(len(heads), dtype=bool)  # by sorted slot
    if chosen:
        taken[rank[chosen]] = True
    else:
        a, b = _best_window(tok_s, cnt_s, lcp, max_tokens=max_tokens, max_items=cap)
        taken[a:b] = True
        tokens_left -= int(tok_s[a:b].sum())
        items_left -= int(cnt_s[a:b].sum())
    _grow(taken, lcp, tok_s, cnt_s, order, tokens_left=tokens_left, items_left=items_left)
    slots = np.flatnonzero(taken)
    if not chosen:  # grouping must beat FIFO on the cost model, else FIFO (fairer) wins
        k = int(np.searchsorted(starts, len(fifo)))  # FIFO took requests 0..k-1 whole
        gain = _saving(slots, lcp) - _saving(np.sort(rank[:k]), lcp)
        if gain <= config.min_gain * float(tok_s[slots].sum()):
            return fifo
    picked = sorted(order[slots].tolist())
    state.count_skips(heads, set(picked), picked[-1])
    return [i for r in picked for i in range(int(starts[r]), int(starts[r + 1]))]


def _lookahead(waiting: Sequence[Entry], *, max_tokens: int, max_items: int) -> Sequence[Entry]:
    """The oldest whole requests within the lookahead budget (all of ``waiting`` if it fits)."""
    total = 0
    for i, e in enumerate(waiting):
        total += len(e.input_ids)
        if total > max_tokens or i >= max_items:
            break
    else:
        return waiting
    j = i  # the first entry past the budget: drop its whole request
    while j > 0 and waiting[j - 1].request_id == waiting[i].request_id:
        j -= 1
    return waiting[:j] if j > 0 else waiting  # j == 0: the head alone is oversized (FIFO splits it)


def _requests(waiting: Sequence[Entry]) -> tuple[np.ndarray, np.ndarray]:
    """Entry boundaries [R+1] of the requests (contiguous runs of request_id) and their tokens [R]."""
    n = len(waiting)
    rid = np.fromiter(map(_REQUEST_ID, waiting), dtype=np.int64, count=n)
    lens = np.fromiter(map(len, map(_INPUT_IDS, waiting)), dtype=np.int64, count=n)
    starts = np.concatenate(([0], np.flatnonzero(rid[1:] != rid[:-1]) + 1, [n]))
    return starts, np.add.reduceat(lens, starts[:-1])


def _build_keys(heads: list[Entry], depth: int) -> list[tuple[bytes, int]]:
    """(big-endian bytes of token+1 zero-padded to depth tokens, key length) per request, in one numpy pass."""
    lens = np.fromiter((min(len(h.input_ids), depth) for h in heads), dtype=np.int64, count=len(heads))
    flat = np.fromiter(
        itertools.chain.from_iterable(h.input_ids[:depth] for h in heads), dtype=np.int64, count=int(lens.sum())
    )
    grid = np.zeros((len(heads), depth), dtype=">u4")  # [S, depth]
    # NOTE: +1 so the zero padding sorts a proper prefix before its extensions.
    grid[np.arange(depth) < lens[:, None]] = flat + 1
    blob, width = grid.tobytes(), 4 * depth
    return [(blob[j * width : (j + 1) * width], n) for j, n in enumerate(lens.tolist())]


def _sorted_keys(keys: list[tuple[bytes, int]], depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Requests in lexicographic order of their keys (stable) and adjacent LCPs [R-1]."""
    blobs = [k[0] for k in keys]
    order = np.asarray(sorted(range(len(keys)), key=blobs.__getitem__), dtype=np.int64)
    grid = np.frombuffer(b"".join([blobs[i] for i in order.tolist()]), dtype=np.uint32)
    grid = grid.reshape(len(keys), depth)  # [R, depth]; byte order is irrelevant to ==
    eq = grid[1:] == grid[:-1]  # [R-1, depth]
    first_diff = np.where(eq.all(axis=1), depth, eq.argmin(axis=1))
    lens = np.fromiter((k[1] for k in keys), dtype=np.int64, count=len(keys))[order]
    return order, np.minimum(first_diff, np.minimum(lens[1:], lens[:-1]))


def _best_window(
    tok: np.ndarray, cnt: np.ndarray, lcp: np.ndarray, *, max_tokens: int, max_items: int
) -> tuple[int, int]:
    """Slots [a, b) of the run in sorted order that fits the budget and shares the most tokens.

    Every start a takes the longest run that fits (LCPs are >= 0), all starts at once.
    """
    cum_t = np.concatenate(([0], np.cumsum(tok)))  # [R+1]
    cum_c = np.concatenate(([0], np.cumsum(cnt)))
    shared = np.concatenate(([0], np.cumsum(lcp)))  # [R]: shared[k] = sum(lcp[:k])
    end = np.minimum(
        np.searchsorted(cum_t, cum_t[:-1] + max_tokens, side="right") - 1,
        np.searchsorted(cum_c, cum_c[:-1] + max_items, side="right") - 1,
    )  # [R] exclusive end of the longest run from each start
    start = np.arange(tok.size)
    gain = np.where(end > start, shared[np.maximum(end - 1, start)] - shared[start], -1)
    a = int(np.argmax(gain))
    return a, int(end[a])


def _grow(
    taken: np.ndarray, lcp: np.ndarray, tok: np.ndarray, cnt: np.ndarray, order: np.ndarray,
    *, tokens_left: int, items_left: int,
) -> None:
    """Fill the budget left with the untaken slots sharing the longest prefix with a taken one.

    A frontier per direction walks outward from each taken slot; the LCP of a candidate with the
    taken set is the minimum of the adjacent LCPs in between (ties: the oldest request first).
    """
    if items_left <= 0 or taken.all():
        return
    smallest = int(tok[~taken].min())
    flags, lcps, toks, cnts, reqs = taken.tolist(), lcp.tolist(), tok.tolist(), cnt.tolist(), order.tolist()
    r_max = len(flags)
    depth_cap = max(lcps, default=0)
    heap: list[tuple[int, int, int, int]] = []  # (-shared, request, slot, step)
    for p in np.flatnonzero(taken).tolist():
        if p > 0 and not flags[p - 1]:
            heapq.heappush(heap, (-lcps[p - 1], reqs[p - 1], p - 1, -1))
        if p + 1 < r_max and not flags[p + 1]:
            heapq.heappush(heap, (-lcps[p], reqs[p + 1], p + 1, 1))
    while heap and items_left > 0 and tokens_left >= smallest:
        neg, _, p, step = heapq.heappop(heap)
        if flags[p]:
            continue
        shared = -neg
        if toks[p] <= tokens_left and cnts[p] <= items_left:
            flags[p] = taken[p] = True
            tokens_left -= toks[p]
            items_left -= cnts[p]
            shared = depth_cap  # the next one's LCP with the taken set is now its LCP with p
        q = p + step
        if 0 <= q < r_max and not flags[q]:
            heapq.heappush(heap, (-min(shared, lcps[min(p, q)]), reqs[q], q, step))


def _saving(slots: np.ndarray, lcp: np.ndarray) -> int:
    """Tokens shared among the keys of the given sorted slots (ascending): adjacent-LCP minima."""
    if slots.size < 2:
        return 0
    padded = np.concatenate((lcp, [0]))  # NOTE: reduceat needs every start index in range
    return int(np.minimum.reduceat(padded, slots)[:-1].sum())

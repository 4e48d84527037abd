"""Batch formation: which waiting entries make up the next forward.

An entry is one input item; entries of one client request share ``request_id`` and stay in one
batch whenever the request fits the budget (a request larger than a whole batch is split, in
order). No entry is longer than the token budget (the server caps input length at
min(model max positions, max_batch_tokens)), so every entry fits an empty batch.
A former is a callable ``former(waiting, now) -> ascending indices into waiting``; it runs on the
prep thread over a snapshot of the queue, never under the queue's lock. This module holds what
every policy shares (``Entry``, the FIFO former, the prefix policy's knobs); the "prefix" former
lives in scheduler/prefix_forming.py, and scheduler/policy.py picks one by name. Nothing here
imports another former.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

# former(waiting, now) -> ascending indices into ``waiting`` of the next batch (never empty).
Former = Callable[[Sequence["Entry"], float], list[int]]


@dataclass(eq=False)  # NOTE: identity equality and hash: the queue removes entries by identity
class Entry:
    """One waiting input item."""

    request_id: int
    input_ids: list[int]
    arrival: float  # time.monotonic() when enqueued
    payload: object = field(default=None, repr=False)  # the scheduler's bookkeeping
    all_tokens: bool = False  # answer every token's final state [L, E], not the pooled output
    namespace: bytes = b""  # prefix-cache namespace: shares cached prefixes only with its own

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)


def form_batch_fifo(
    waiting: Sequence[Entry], *, max_tokens: int, max_requests: int | None = None
) -> list[int]:
    """Indices (into ``waiting``, ascending) of the next batch in arrival order.

    Requests are taken whole while they fit; the first request that does not fit closes the
    batch, unless the batch is still empty, in which case it is split (it cannot fit anywhere).
    """
    cap = max_requests if max_requests is not None else len(waiting)
    chosen: list[int] = []
    tokens = 0
    i = 0
    while i < len(waiting) and len(chosen) < cap:
        j = i
        group_tokens = 0
        while j < len(waiting) and waiting[j].request_id == waiting[i].request_id:
            group_tokens += waiting[j].n_tokens
            j += 1
        fits_whole = tokens + group_tokens <= max_tokens and len(chosen) + (j - i) <= cap
        if fits_whole:
            chosen.extend(range(i, j))
            tokens += group_tokens
            i = j
            continue
        if chosen:
            break
        # An empty batch and a request larger than the budget: split it in order.
        while i < j and len(chosen) < cap and tokens + waiting[i].n_tokens <= max_tokens:
            chosen.append(i)
            tokens += waiting[i].n_tokens
            i += 1
        break
    return chosen


@dataclass(frozen=True)
class PrefixPolicy:
    """Knobs of the "prefix" policy (defaults sized for 16k-token batches of 50-250 ms)."""

    # Aging: a request waiting this long is taken before any grouping, oldest first. About 2x
    # the forward time of a full batch of the largest model we serve, so it only bites when the
    # queue is deeper than a couple of batches (then the policy degrades to oldest-first).
    max_wait_s: float = 0.5
    # Aging: a request passed over this many times (a later request was batched instead) is
    # taken first in the next batch, so reordering never delays anything by more batches.
    max_skips: int = 2
    # Leading tokens compared between requests: deeper than the reranker's system prompt,
    # instruction and query (~60-100 tokens), so requests group by query, not by template.
    depth: int = 128
    # Only the oldest this-many batches' worth of the queue is considered: bounds the cost per
    # batch whatever the queue depth, and how far ahead a request can jump.
    lookahead_batches: int = 8
    # Reorder only when it pays: the grouped batch must save at least this share of its tokens
    # more than the FIFO batch would. Behind a shared template with short queries, grouping
    # saves only a few percent and costs tail latency, so FIFO is kept there (docs/decisions.md,
    # "The prefix policy forms at once").
    min_gain: float = 0.10

    def __post_init__(self) -> None:
        if (self.max_wait_s < 0 or self.max_skips < 0 or self.depth < 1 or self.lookahead_batches < 1
                or not 0.0 <= self.min_gain < 1.0):
            raise ValueError(f"invalid prefix batching policy {self}")


"""Batch formation: which waiting entries make up the next forward.

An entry is one input item; entries of one client request share ``request_id`` and stay in one
batch whenever the request fits the budget (a request larger than a whole batch is split, in
order). No entry is longer than the token budget (the server caps input length at
min(model max positions, max_batch_tokens)), so every entry fits an empty batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class Entry:
    """One waiting input item."""

    request_id: int
    input_ids: list[int]
    arrival: float  # time.monotonic() when enqueued
    payload: object = field(default=None, repr=False)  # the scheduler's bookkeeping

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


def form_batch(
    waiting: Sequence[Entry],
    *,
    max_tokens: int,
    max_requests: int | None = None,
    policy: str = "fifo",
    now: float | None = None,
) -> list[int]:
    """The next batch under ``policy`` ("fifo"; "prefix" is added by the prefix-aware former)."""
    if policy == "fifo":
        return form_batch_fifo(waiting, max_tokens=max_tokens, max_requests=max_requests)
    raise ValueError(f"unknown batching policy {policy!r}")

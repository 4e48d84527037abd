"""Which block the prefix cache evicts next: the least recently used unpinned block, a leaf.

The order holds every committed block that no lease pins, least recently used first, in an
OrderedDict keyed by block id (a doubly linked list inside): adding a block at the newest end,
moving it there, taking it out and popping the oldest are O(1) each, whatever the number of
blocks, with no stale entries to skip and no rebuild.

A use is counted when the batch that used a block settles (commit or abort): while a lease pins a
block it cannot be evicted, so only the last settling matters. A batch that settles puts what it
used at the newest end in the reverse of the order it walked it: its new blocks (or the published
blocks they duplicate) from the last one planned back to the first, then the blocks it read from
the last one pinned back to the first. Both walks put a parent before its children, so the order
always holds a block's committed children before the block itself:
- a lease pins whole chains from position 0 (a block's parent is pinned whenever it is), so an
  unpinned block has no pinned descendant: its committed children are all in the order;
- a settling moves a block and its children it used in children-first order to the newest end,
  and leaves its other children where they were, older.
So the oldest block in the order has no committed children: popping it is exactly taking the least
recently used evictable leaf, without tracking leaves at all (a parent whose last child was evicted
is already where its own last use put it). Ties within one settling (blocks used by the same
batch) go children first; among unrelated chains, last walked first.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EvictionOrder:
    """Committed unpinned blocks, least recently used first (an OrderedDict by block id)."""

    __slots__ = ("_lru",)

    def __init__(self) -> None:
        self._lru: OrderedDict[int, Any] = OrderedDict()

    def add(self, b: Any) -> None:
        """`b` was published or unpinned by a settling batch: the newest block."""
        self._lru[b.id] = b

    def use_all(self, blocks) -> None:
        """Each of `blocks` in turn, unpinned and used by a settling batch (published by it, or
        duplicated by one of its blocks), becomes the newest block, added or moved there."""
        lru = self._lru
        move = lru.move_to_end
        for b in blocks:
            lru[b.id] = b
            move(b.id)

    def pin(self, b: Any) -> None:
        """`b`, unpinned until now, is pinned by a lease: out of the order until it settles."""
        del self._lru[b.id]

    def pop(self) -> Any:
        """The least recently used unpinned block (always a leaf), taken out; None if there is none."""
        return self._lru.popitem(last=False)[1] if self._lru else None

    def blocks(self) -> list[Any]:
        """The blocks, oldest first (tests check the order)."""
        return list(self._lru.values())

    def clear(self) -> None:
        self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)

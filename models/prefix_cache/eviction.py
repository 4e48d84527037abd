"""Which block the prefix cache evicts next: the least recently used evictable leaf.

A block is evictable when it is committed, pinned by no lease (refs 0) and has no committed
children. Every block carries `used`, the tick of its last use (one tick per plan or commit; all
blocks a lease touches share it), and evictable blocks wait in a heap keyed (used, -depth, id):
least recently used first, and within one tick the deepest first, so a chain touched together
loses its leaf before its parent. Blocks leave the evictable set (pinned, given a child, touched
again) without a heap operation: each entry is checked when popped and dropped if stale. The
cache calls `offer` whenever a block may have become evictable or got a new tick (unpinned, its
last child dropped, published, touched while evictable), so the heap's first valid entry is always
the block that a scan of all committed blocks in LRU order would find first. Each push and pop is
O(log n); a stale entry is popped at most once, and the heap is rebuilt from its valid entries when
stale ones outnumber them, so the cost per block touched stays bounded.
"""
from __future__ import annotations

import heapq
from typing import Any


class EvictionOrder:
    """Evictable blocks, least recently used first (a heap with lazy deletion)."""

    __slots__ = ("_heap", "tick")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Any]] = []  # (used, -depth, id, block)
        self.tick = 0

    def next_tick(self) -> int:
        self.tick += 1
        return self.tick

    def offer(self, b: Any) -> None:
        """`b` may be evictable now, or was touched while evictable: queue it at its tick."""
        if b.live and not b.refs and not b.children:
            heapq.heappush(self._heap, (b.used, -b.depth, b.id, b))

    def pop(self) -> Any:
        """The least recently used evictable block, taken out of the order; None if there is none."""
        heap = self._heap
        while heap:
            used, _, _, b = heapq.heappop(heap)
            if b.live and not b.refs and not b.children and b.used == used:
                return b
        return None

    def trim(self, live_blocks: int) -> None:
        """Rebuild from the valid entries once stale ones outnumber the committed blocks."""
        if len(self._heap) > 2 * live_blocks + 64:
            self._compact()

    def _compact(self) -> None:
        seen: set[int] = set()
        keep = []
        for entry in self._heap:
            b = entry[3]
            if b.live and not b.refs and not b.children and b.used == entry[0] and b.id not in seen:
                seen.add(b.id)
                keep.append(entry)
        heapq.heapify(keep)
        self._heap = keep

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)

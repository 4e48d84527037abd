"""The prefix cache's records: a cached block of tokens, and one batch's lease on the cache.

A `Block` is a node of the block index (blocks.py): `block` token ids, or fewer for a tail block,
the pool slot holding their K/V rows, its parent and its committed children's token bytes. A
`Lease` is what `PrefixCache.plan` (planner.py) hands a batch: the pool rows each sequence reads,
the blocks it writes, and the blocks it pins until the batch settles (commit or abort).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from models.prefix_cache.siblings import Kids, count


@dataclass(eq=False, slots=True)
class Block:
    id: int
    parent: "Block | None"
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
    pinned: list[Block] = field(default_factory=list)  # each block read, once
    pending: list[Block] = field(default_factory=list)  # parents before children
    hits: int = 0  # tokens read from the cache, set by layout.plan_batch
    misses: int = 0
    done: bool = False  # committed or aborted
    queued: bool = False  # handed to `commit_later`: only a commit settles it now

"""One batch planned against the prefix cache: what each sequence reads, and which blocks it writes.

`PrefixCache.plan` (blocks.py) makes one `BatchPlanner` per batch, under the index's lock, and hands
it the batch's sequences in order (`add`). Each sequence goes through five steps:

1. reuse: the leading complete blocks it shares with the sequence before it (found by one
   vectorised comparison, shared.py) take over that sequence's look-ups and write choices;
2. `_look_up_chain`: the rest of its chain of cached complete blocks, one dict look-up each;
3. `_look_up_partial`: past that chain, the committed child sharing the most leading tokens
   (1..block-1) with what follows (siblings.py), or the previous sequence's answer when it asks
   the same question;
4. `_write_blocks`: a pending block for each complete block that is not cached, shared with the
   earlier sequence of the batch that chose the same block;
5. `_write_tail`: its last t < block tokens as a tail block, unless a committed block starts with
   them or the batch already writes them.

Each block read is pinned once per lease (`_pin`); `lease` turns what was gathered into the
`Lease`'s arrays. Cost and invariants: blocks.py.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from models.prefix_cache.eviction import EvictionOrder
from models.prefix_cache.lease import Block, Lease
from models.prefix_cache.siblings import Siblings, longest, starts_with

# a block's index key: (its parent's id, or for a first block its namespace root; its token bytes)
Key = tuple[int | bytes, bytes]


class BatchPlanner:
    """One plan's state: the lease being filled, the blocks it writes by key, and what the previous
    sequence found (its chain, its partial look-up), which the next sequence reuses."""

    __slots__ = ("index", "siblings", "order", "free", "evict", "next_id", "block", "width", "raw",
                 "mark", "pinned", "new_blocks", "pending", "matched", "run_rows", "partial_runs",
                 "partial_lens", "write_starts", "write_slots", "tail_blocks", "tail_lens",
                 "prev_chain", "prev_rows", "prev_cached", "last_parent_key", "last_query", "last_answer")

    def __init__(self, *, index: dict[Key, Block], siblings: Siblings, order: EvictionOrder,
                 free: list[int], evict: Callable[[], int | None], next_id: Callable[[], int],
                 block: int, raw: bytes, mark: int):
        self.index, self.siblings, self.order = index, siblings, order  # the cache's, under its lock
        self.free, self.evict, self.next_id = free, evict, next_id
        self.block, self.width = block, 4 * block  # tokens of a complete block, and its bytes in raw
        self.raw = raw  # the batch's tokens as int32 bytes: batch row r is raw[4r:4r+4]
        self.mark = mark  # this plan's number: a block it pinned carries it
        self.pinned: list[Block] = []  # each block read, once (the lease's)
        self.new_blocks: list[Block] = []  # the blocks written, parents before children (the lease's)
        self.pending: dict[Key, Block] = {}  # the same by key: a later sequence of the batch shares them
        self.matched: list[int] = []  # tokens of each sequence found in the cache
        self.run_rows: list[int] = []  # first pool row of each read run (a chain block, or a partial one)
        self.partial_runs: list[int] = []  # which runs are partial, and their lengths
        self.partial_lens: list[int] = []
        self.write_starts: list[int] = []  # batch row of each new block's first token
        self.write_slots: list[int] = []  # pool slot of each new block
        self.tail_blocks: list[int] = []  # which new blocks are tails, and their lengths
        self.tail_lens: list[int] = []
        self.prev_chain: list[Block] = []  # the previous sequence's complete blocks: cached, then new
        self.prev_rows: list[int] = []  # first pool row of each of its cached blocks
        self.prev_cached = 0  # how many of its complete blocks were cached
        self.last_parent_key: int | bytes | None = None  # the last partial look-up's question
        self.last_query = b""
        self.last_answer: tuple[bytes | None, int] = (None, 0)  # and its answer (`longest`)

    def add(self, start: int, end: int, root: int | bytes, shared: int) -> None:
        """Plan the sequence of batch rows start..end-1 in namespace `root` (0: the shared one),
        whose first `shared` tokens equal the previous sequence's."""
        block, prev_chain, prev_cached = self.block, self.prev_chain, self.prev_cached
        n_full = (end - start) // block  # its complete blocks
        # step 1: the leading complete blocks equal to the previous sequence's
        reused = min(shared // block, n_full, len(prev_chain))
        if reused > prev_cached:
            # past its cached chain the previous sequence missed at the same key: no look-up to redo
            cached, chain, rows = prev_cached, prev_chain[:reused], self.prev_rows
        else:
            chain, rows = prev_chain[:reused], self.prev_rows[:reused]
            cached = self._look_up_chain(chain, rows, root, start, n_full) if reused < n_full else reused
        self.run_rows.extend(rows)
        after = start + cached * block  # its first token past the cached chain
        # the last token is always computed, so a partial match needs at most n-1 tokens
        most = min(block - 1, end - 1 - after)
        partial = 0
        if most > 0:
            partial = self._look_up_partial(chain[cached - 1] if cached else None, root, after, most)
        self.matched.append(cached * block + partial)
        self._write_blocks(chain, root, start, end)
        self.prev_chain, self.prev_rows, self.prev_cached = chain, rows, cached

    def _pin(self, found: Block) -> None:
        """Hold `found` for this lease (out of the eviction order), once per plan whatever the
        number of its sequences through it."""
        if found.mark != self.mark:
            found.mark = self.mark
            if not found.refs:
                self.order.pin(found)
            found.refs += 1
            self.pinned.append(found)

    def _look_up_chain(self, chain: list[Block], rows: list[int], root: int | bytes, start: int,
                       n_full: int) -> int:
        """Step 2: extend `chain`, and `rows` with their first pool rows, by the cached complete
        blocks that follow it, pinning each; returns the length of the cached chain."""
        index, pin, mark = self.index, self._pin, self.mark
        raw, block, width = self.raw, self.block, self.width
        cached = len(chain)
        parent_key = chain[-1].id if chain else root
        at = 4 * start + cached * width  # the next block's first byte in raw
        while cached < n_full:
            found = index.get((parent_key, raw[at:at + width]))
            if found is None:
                break
            if found.mark != mark:  # not pinned by this plan yet
                pin(found)
            chain.append(found)
            rows.append(found.slot * block)
            parent_key, cached, at = found.id, cached + 1, at + width
        return cached

    def _look_up_partial(self, parent: Block | None, root: int | bytes, after: int, most: int) -> int:
        """Step 3: the committed child of `parent` (None: of the root) sharing the most of the
        `most` tokens from batch row `after` on; its rows are read (a partial run) and it is
        pinned. Returns the tokens it shares (0: none)."""
        parent_key = parent.id if parent is not None else root
        query = self.raw[4 * after:4 * (after + most)]
        if parent_key != self.last_parent_key or query != self.last_query:
            # NOTE: the same question as the last sequence's gets its answer: during a plan
            # committed blocks only leave (evicted unpinned), and the one it found is pinned, so
            # the longest match and its tie-break are unchanged.
            self.last_parent_key, self.last_query = parent_key, query
            self.last_answer = longest(parent.kids if parent is not None else self.siblings.get(root), query)
        tokens, shared = self.last_answer
        if tokens is None:
            return 0
        found = self.index[(parent_key, tokens)]
        self._pin(found)
        self.partial_runs.append(len(self.run_rows))
        self.partial_lens.append(shared)
        self.run_rows.append(found.slot * self.block)
        return shared

    def _write_blocks(self, chain: list[Block], root: int | bytes, start: int, end: int) -> None:
        """Step 4: extend `chain` (cached blocks, then the previous sequence's new ones: the same
        tokens) by a block for each remaining complete block, the batch's own when an earlier
        sequence chose it, else a new one; then step 5. A pool full of pinned blocks stops the
        sequence's writes at the first block it cannot place (and leaves out its tail)."""
        block = self.block
        n_full = (end - start) // block
        depth = len(chain)
        parent = chain[-1] if chain else None
        fresh = False  # the sequence made a block: no block of the batch sits under it yet
        if depth < n_full:
            raw, width, pending = self.raw, self.width, self.pending
            free, evict, next_id = self.free, self.evict, self.next_id
            add_new, add_start = self.new_blocks.append, self.write_starts.append
            add_slot = self.write_slots.append
            parent_key = parent.id if parent is not None else root
            at = 4 * (start + depth * block)  # the next block's first byte in raw
            while depth < n_full:
                key = (parent_key, raw[at:at + width])
                own = None if fresh else pending.get(key)
                if own is None:
                    # NOTE: `_new_block` written out: the per-block loop makes no call of its own
                    slot = free.pop() if free else evict()
                    if slot is None:
                        return  # every slot pinned or pending: nothing deeper is written
                    own = pending[key] = Block(next_id(), parent, key[1], depth, slot,
                                               0 if parent is not None else root)
                    add_new(own)
                    add_start(start + depth * block)
                    add_slot(slot)
                    fresh = True
                chain.append(own)
                parent, parent_key, depth, at = own, own.id, depth + 1, at + width
        tail = end - (start + n_full * block)
        if tail:
            self._write_tail(parent, root, end, tail, n_full, fresh)

    def _write_tail(self, parent: Block | None, root: int | bytes, end: int, tail: int, depth: int,
                    fresh: bool) -> None:
        """Step 5: the sequence's last `tail` (< block) tokens as a tail block under `parent`, at
        `depth` (its complete blocks),
        unless the batch already writes them (`fresh`: `parent` is this sequence's own new block,
        so it cannot) or a committed child of `parent` starts with them (they are cached)."""
        key = (parent.id if parent is not None else root, self.raw[4 * (end - tail):4 * end])
        if not fresh and key in self.pending:
            return
        if starts_with(parent.kids if parent is not None else self.siblings.get(root), key[1]):
            return
        if self._new_block(key, parent, root, depth, end - tail) is not None:
            self.tail_blocks.append(len(self.new_blocks) - 1)
            self.tail_lens.append(tail)

    def _new_block(self, key: Key, parent: Block | None, root: int | bytes, depth: int,
                   first_row: int) -> Block | None:
        """A block of the batch for `key` at `depth`, its rows from batch row `first_row` written
        to a free slot or to the least recently used unpinned block's (evicted); None when every
        slot is pinned or pending. (`_write_blocks` does the same inline.)"""
        free = self.free
        slot = free.pop() if free else self.evict()
        if slot is None:
            return None
        made = Block(self.next_id(), parent, key[1], depth, slot, 0 if parent is not None else root)
        self.pending[key] = made
        self.new_blocks.append(made)
        self.write_starts.append(first_row)
        self.write_slots.append(slot)
        return made

    def lease(self) -> Lease:
        """The plan as the lease's arrays: the pool row of each token read, and where each new
        block's rows come from and go."""
        block = self.block
        read_rows = np.zeros(0, np.int64)
        if self.run_rows:
            lens = np.full(len(self.run_rows), block, dtype=np.int64)  # [runs] rows read from each
            lens[self.partial_runs] = self.partial_lens
            within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
            read_rows = np.repeat(np.asarray(self.run_rows, dtype=np.int64), lens) + within  # [sum matched]
        write_lens = np.full(len(self.write_slots), block, dtype=np.int64)  # [W]
        write_lens[self.tail_blocks] = self.tail_lens
        return Lease(matched=np.asarray(self.matched, dtype=np.int64), read_rows=read_rows,
                     write_starts=np.asarray(self.write_starts, dtype=np.int64),
                     write_slots=np.asarray(self.write_slots, dtype=np.int64), write_lens=write_lens,
                     pinned=self.pinned, pending=self.new_blocks)

"""The partial look-up: which committed child of a block shares the most leading tokens with a query.

Per parent key (a parent block's id, or a namespace root: 0 or bytes) the committed children's
token bytes are kept in one sorted list. Token ids are int32, fixed 4-byte units, so byte order
groups children by their leading tokens: the child sharing the longest run of leading bytes with a
query sits next to the query's insertion point (one of its two neighbours), and whole shared
tokens are shared bytes // 4. A look-up is one bisection and two comparisons; adding or removing a
child is one bisection and one list insert or delete. No entry exists per leading-token count.

Invariant: a parent's list holds exactly the token bytes of its committed children, each once
(the block index keys a child by (parent key, token bytes), so two children never hold the same
bytes), and lists are never empty (a parent without children has no entry).
"""
from __future__ import annotations

from bisect import bisect_left, insort


class Siblings:
    """Committed children's token bytes per parent key, sorted."""

    __slots__ = ("_kids",)

    def __init__(self) -> None:
        self._kids: dict[int | bytes, list[bytes]] = {}

    def add(self, parent: int | bytes, tokens: bytes) -> None:
        kids = self._kids.get(parent)
        if kids is None:
            self._kids[parent] = [tokens]
        else:
            insort(kids, tokens)

    def remove(self, parent: int | bytes, tokens: bytes) -> None:
        kids = self._kids[parent]
        if len(kids) == 1:
            del self._kids[parent]
            return
        del kids[bisect_left(kids, tokens)]

    def longest(self, parent: int | bytes, query: bytes) -> tuple[bytes | None, int]:
        """The child of `parent` sharing the most leading tokens with `query` (int32 bytes), and
        that count; (None, 0) when no child starts with the query's first token."""
        kids = self._kids.get(parent)
        if not kids or not query:
            return None, 0
        i = bisect_left(kids, query)
        best, count = None, 0
        if i < len(kids):
            best, count = kids[i], _shared_tokens(kids[i], query)
        if i and count * 4 < len(query):
            c = _shared_tokens(kids[i - 1], query)
            if c > count:
                best, count = kids[i - 1], c
        return (best, count) if count else (None, 0)

    def starts_with(self, parent: int | bytes, query: bytes) -> bool:
        """Does a child of `parent` start with all of `query`'s tokens?"""
        kids = self._kids.get(parent)
        if not kids:
            return False
        i = bisect_left(kids, query)  # the first child >= query: the only candidate
        return i < len(kids) and kids[i].startswith(query)

    def clear(self) -> None:
        self._kids.clear()

    def items(self):
        """(parent key, sorted token bytes) pairs (tests recount them)."""
        return self._kids.items()


def _shared_tokens(a: bytes, b: bytes) -> int:
    """Leading int32 tokens a and b share: a binary search over equal byte prefixes."""
    lo, hi = 0, min(len(a), len(b)) // 4
    if a[:4 * hi] == b[:4 * hi]:
        return hi
    hi -= 1
    while lo < hi:  # a[:4lo] == b[:4lo], a[:4(hi+1)] != b[:4(hi+1)]
        mid = (lo + hi + 1) // 2
        if a[:4 * mid] == b[:4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo

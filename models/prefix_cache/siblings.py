"""The partial look-up: which committed child of a block shares the most leading tokens with a query.

A parent's committed children are kept as one value, its *kids*: None (no child), the one child's
token bytes, or a sorted list of two or more children's token bytes. A block holds its own kids
(`Block.kids`, lease.py: no dict look-up on the hot path); the namespace roots (0, or a namespace's bytes),
which are not blocks, keep theirs in a `Siblings` map. Token ids are int32, fixed 4-byte units, so
byte order groups children by their leading tokens: the child sharing the longest run of leading
bytes with a query sits next to the query's insertion point (one of its two neighbours), and whole
shared tokens are shared bytes // 4. A look-up is one bisection and two comparisons; adding or
removing a child is one bisection and one list insert or delete (an attribute store while a parent
has one child, the common case deep in a chain). No entry exists per leading-token count.

Invariant: a parent's kids hold exactly the token bytes of its committed children, each once (the
block index keys a child by (parent key, token bytes), so two children never hold the same bytes);
a list always holds two or more.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from typing import Union

Kids = Union[None, bytes, list[bytes]]  # no child / one child's token bytes / >= 2 sorted


def added(kids: Kids, tokens: bytes) -> Kids:
    """`kids` with the child `tokens` added (the list is changed in place)."""
    if kids is None:
        return tokens
    if isinstance(kids, bytes):
        return [kids, tokens] if kids < tokens else [tokens, kids]
    insort(kids, tokens)
    return kids


def removed(kids: Kids, tokens: bytes) -> Kids:
    """`kids` without the child `tokens`, which it holds."""
    if not isinstance(kids, list):
        return None
    del kids[bisect_left(kids, tokens)]
    return kids[0] if len(kids) == 1 else kids


def count(kids: Kids) -> int:
    return 0 if kids is None else 1 if isinstance(kids, bytes) else len(kids)


def as_list(kids: Kids) -> list[bytes]:
    """The children's token bytes, sorted."""
    return [] if kids is None else [kids] if isinstance(kids, bytes) else list(kids)


def longest(kids: Kids, query: bytes) -> tuple[bytes | None, int]:
    """The child sharing the most leading tokens with `query` (int32 bytes), and that count;
    (None, 0) when no child starts with the query's first token."""
    if kids is None or not query:
        return None, 0
    if isinstance(kids, bytes):
        count = _shared_tokens(kids, query)
        return (kids, count) if count else (None, 0)
    i = bisect_left(kids, query)
    best, count = None, 0
    if i < len(kids):
        best, count = kids[i], _shared_tokens(kids[i], query)
    if i and count * 4 < len(query):
        c = _shared_tokens(kids[i - 1], query)
        if c > count:
            best, count = kids[i - 1], c
    return (best, count) if count else (None, 0)


def starts_with(kids: Kids, query: bytes) -> bool:
    """Does a child start with all of `query`'s tokens?"""
    if kids is None:
        return False
    if isinstance(kids, bytes):
        return kids.startswith(query)
    i = bisect_left(kids, query)  # the first child >= query: the only candidate
    return i < len(kids) and kids[i].startswith(query)


class Siblings:
    """Kids per parent key, for parents that are not blocks (the namespace roots)."""

    __slots__ = ("_kids",)

    def __init__(self) -> None:
        self._kids: dict[int | bytes, Kids] = {}

    def get(self, parent: int | bytes) -> Kids:
        return self._kids.get(parent)

    def add(self, parent: int | bytes, tokens: bytes) -> None:
        self._kids[parent] = added(self._kids.get(parent), tokens)

    def remove(self, parent: int | bytes, tokens: bytes) -> None:
        kids = removed(self._kids[parent], tokens)
        if kids is None:
            del self._kids[parent]
        else:
            self._kids[parent] = kids

    def clear(self) -> None:
        self._kids.clear()

    def items(self):
        """(parent key, sorted token bytes) pairs (tests recount them)."""
        return ((k, as_list(v)) for k, v in self._kids.items())


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

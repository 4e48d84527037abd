"""The per-request budget of rerank pair tokens: one query against many documents.

A rerank request becomes one sequence per document, template + query + document. The trie and
tree attention keep its *memory* at query + documents (the shared part is one set of rows, read
once per layer), but every document's tokens still attend to the whole query, so attention
*work* grows with query x documents; and the pairs' token lists are materialised on the way in.
The budget bounds what one request may cost, counted before any pair is built.

Invariant: `pair_tokens` equals the sum of the lengths the template encoder's pairs will have (each pair
capped at `max_length`, as truncation or the length check leaves it), so a request under the
budget is never refused and one over it is refused before its pairs exist.
"""
from __future__ import annotations

from collections.abc import Sequence

FLAG = "--max-rerank-pair-tokens"


class PairBudgetExceeded(ValueError):
    """A rerank request whose pairs hold more tokens together than the per-request budget."""

    def __init__(self, tokens: int, documents: int, limit: int) -> None:
        super().__init__(
            f"this rerank request's {documents} query-document pairs hold {tokens} tokens together, "
            f"more than the per-request limit of {limit} ({FLAG}); send fewer or shorter documents, "
            f"a shorter query, or raise {FLAG}"
        )
        self.tokens, self.documents, self.limit = tokens, documents, limit


def pair_tokens(*, overhead: int, bodies: Sequence[int], max_length: int) -> int:
    """Tokens of all pairs: per pair min(overhead + its body's tokens, max_length).

    overhead: the template's tokens around the body (prefix + suffix); bodies: each pair's body
    (instruction, query and document) before any cut. A body over the budget is cut to it with
    truncation, or refused without; either way no pair holds more than max_length tokens.
    """
    return sum(min(overhead + b, max_length) for b in bodies)


def check_pair_budget(tokens: int, *, documents: int, limit: int, counted: tuple[int, int] = (0, 0)) -> None:
    """Raise PairBudgetExceeded when `tokens` and the `counted` (tokens, pairs) of the request's
    other queries are over `limit` together (0: no limit): one budget per request, whatever its shape
    (/score's list of text_1 is one query per pair)."""
    tokens, documents = tokens + counted[0], documents + counted[1]
    if limit > 0 and tokens > limit:
        raise PairBudgetExceeded(tokens, documents, limit)

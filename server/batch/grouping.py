"""Corpus-wide prefix grouping: the order in which one window of request lines is run.

An online server batches what arrives together; offline, the whole input is known. The job reads
the input in windows of ``--window`` lines and runs each window's lines sorted by their token
prefix, so lines that share a prefix (one query's candidates, one prompt's sampled answers, one
document's chunks) enter the scheduler one after another and meet in one batch, where RadixMLP
computes the shared prefix once, and in the prefix cache. The answers are written in input order.

The key of a line is the token ids of the text its route puts first: the query (then the first
document) of a rerank body; the first input of an embedding body (pre-tokenized inputs are their
own key). Prompts and templates are the same for every line of one route, so lines are sorted by
(route, key). Keys are cut to ``KEY_TOKENS`` tokens, so a window holds at most
window x KEY_TOKENS ids besides its lines. A body the route will refuse gets an empty key: it is
answered by the route like any other line.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from server.batch.lines import Request

KEY_TOKENS = 256  # tokens of a line's key: sharing beyond them changes nothing in the order that matters
KEY_CHARS = 8 * KEY_TOKENS  # characters tokenized for a key (a token is rarely longer than 8 characters)


def key_text(url: str, body: dict) -> str | list[int]:
    """The text (or token ids) a route's model input starts with, after its fixed prompt/template."""
    query = body.get("query")
    if isinstance(query, str):  # every rerank dialect: query + documents (or TEI's texts)
        docs = body.get("documents", body.get("texts"))
        first = docs[0] if isinstance(docs, list) and docs else ""
        if isinstance(first, dict):
            first = first.get("text", "")
        return query + "\n" + (first if isinstance(first, str) else "")
    for field in ("input", "inputs", "texts"):  # OpenAI, TEI, Cohere embedding bodies
        value = body.get(field)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            first = value[0]
            if isinstance(first, str):
                return first
            if type(first) is int:
                return [t for t in value[:KEY_TOKENS] if type(t) is int]
            if isinstance(first, list):
                return [t for t in first[:KEY_TOKENS] if type(t) is int]
    return ""


def keys(requests: Sequence[Request], encode_batch: Callable[[list[str]], list[Any]]) -> list[tuple[int, ...]]:
    """The token-prefix key of each request (``encode_batch``: the tokenizer's, no special tokens)."""
    raw = [key_text(r.url, r.data) for r in requests]
    texts = [k[:KEY_CHARS] for k in raw if isinstance(k, str)]
    encoded = iter(encode_batch(texts)) if texts else iter(())
    out = []
    for k in raw:
        ids = k if isinstance(k, list) else next(encoded).ids
        out.append(tuple(ids[:KEY_TOKENS]))
    return out


def grouped_order(requests: Sequence[Request], encode_batch: Callable[[list[str]], list[Any]]) -> list[int]:
    """Indices of ``requests`` sorted by (route, token prefix); ties keep input order."""
    ks = keys(requests, encode_batch)
    return sorted(range(len(requests)), key=lambda i: (requests[i].url, ks[i]))


def shared_prefix_tokens(order: Sequence[int], ks: Sequence[tuple[int, ...]]) -> int:
    """Key tokens each line shares with the line run just before it, summed: how much of its prefix
    a batch can reuse in this order (a cheap figure to compare orders by, not the model's N'/N)."""
    total = 0
    for a, b in zip(order, order[1:]):
        x, y = ks[a], ks[b]
        n = 0
        for p, q in zip(x, y):
            if p != q:
                break
            n += 1
        total += n
    return total

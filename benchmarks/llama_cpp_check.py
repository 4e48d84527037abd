"""Does a llama-server read the checkpoint as radixserve does? Token ids and embedding cosines.

Both checks speak HTTP to servers that are already up, so they hold for whatever weights each one
serves: llama-server's ``POST /tokenize {content, add_special}`` against radixserve's TEI
``POST /tokenize {inputs}`` (ids with the tokenizer's own special tokens, so the ``<|endoftext|>``
an embedding tokenizer appends is compared too), and every arm's ``/v1/embeddings`` vectors against
a reference arm's (radixserve with fp32 weights) as cosines, per text.
"""
from __future__ import annotations

import math

import httpx


def our_token_ids(url: str, texts: list[str], *, timeout: float = 60.0) -> list[list[int]]:
    """radixserve's ids for each text (TEI /tokenize, special tokens added as the model does)."""
    r = httpx.post(url + "/tokenize", json={"inputs": texts, "add_special_tokens": True}, timeout=timeout)
    r.raise_for_status()
    return [[int(t["id"]) for t in row] for row in r.json()]


def llama_token_ids(url: str, texts: list[str], *, timeout: float = 60.0) -> list[list[int]]:
    """llama-server's ids for each text (/tokenize with add_special: its BOS/EOS rules apply)."""
    out = []
    with httpx.Client(base_url=url, timeout=timeout) as c:
        for text in texts:
            r = c.post("/tokenize", json={"content": text, "add_special": True})
            r.raise_for_status()
            out.append([int(t) for t in r.json()["tokens"]])
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two id lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_tokens(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """{texts, equal, first_mismatch: {text, position, ours, theirs} or None}."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} id lists against {len(theirs)}")
    equal, mismatch = 0, None
    for i, (a, b) in enumerate(zip(ours, theirs)):
        pos = first_difference(a, b)
        if pos is None:
            equal += 1
        elif mismatch is None:
            mismatch = {"text": i, "position": pos, "ours": a[pos:pos + 4], "theirs": b[pos:pos + 4]}
    return {"texts": len(ours), "equal": equal, "first_mismatch": mismatch}


def embeddings(url: str, texts: list[str], *, timeout: float = 600.0) -> list[list[float]]:
    """One vector per text from /v1/embeddings (float), in input order."""
    r = httpx.post(url + "/v1/embeddings", json={"input": texts}, timeout=timeout)
    r.raise_for_status()
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    if len(data) != len(texts):
        raise ValueError(f"{url}: {len(data)} embeddings for {len(texts)} texts")
    return [list(map(float, d["embedding"])) for d in data]


def cosine(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} dimensions")
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    if na == 0 or nb == 0:
        raise ValueError("a zero vector has no direction")
    return dot / (na * nb)


def cosines(reference: list[list[float]], other: list[list[float]]) -> dict:
    """Per-text cosines of `other` against `reference`: {min, mean, per_text}."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference vectors against {len(other)}")
    per = [cosine(a, b) for a, b in zip(reference, other)]
    return {"min": min(per), "mean": sum(per) / len(per), "per_text": per}

"""Long documents and their chunks, for the `embed-chunks` workload.

The dataset's passages, in dataset order, form one stream of words (split on whitespace). Documents
are consecutive slices of that stream, each of a length drawn from `doc_words`; the tail too short
for the next document is dropped. Each document is cut, in order, into chunks of lengths drawn from
`chunk_words`; a remainder shorter than the minimum joins the last chunk (so no chunk is a stray
word or two; the last one may reach MAX + MIN - 1 words).

Invariants the workload relies on: every chunk is a verbatim substring of its document, a
document's chunks joined by single spaces give the document back, and the result depends only on
the dataset, the ranges and `seed` (its own `random.Random`, never the global one).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.datasets import Dataset

# ~1.1 tokens per word on the synthetic text (Qwen BPE), ~1.3 on MS MARCO: documents of ~1000-2000
# tokens and chunks of ~128-256.
DOC_WORDS = (1000, 1800)
CHUNK_WORDS = (120, 220)


def _check(name: str, r: tuple[int, int]) -> None:
    lo, hi = r
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"{name} must be (MIN, MAX) integers with 1 <= MIN <= MAX, got {r!r}")


@dataclass(frozen=True)
class Chunking:
    doc_words: tuple[int, int] = DOC_WORDS  # words per document, inclusive
    chunk_words: tuple[int, int] = CHUNK_WORDS  # words per chunk, inclusive (the last may be longer)

    def __post_init__(self) -> None:
        _check("doc_words", self.doc_words)
        _check("chunk_words", self.chunk_words)

    def label(self) -> str:
        """`doc_words=MIN-MAX,chunk_words=MIN-MAX` for reports."""
        (dl, dh), (cl, ch) = self.doc_words, self.chunk_words
        return f"doc_words={dl}-{dh},chunk_words={cl}-{ch}"


def documents(dataset: Dataset, *, chunking: Chunking = Chunking(), seed: int = 0) -> list[tuple[str, list[str]]]:
    """[(document, [chunk, ...]), ...] in stream order (module docstring). ValueError when the
    data does not fill a single document."""
    rng = random.Random(seed)
    words = [w for s in dataset.samples for p in s.passages for w in p.split()]
    out: list[tuple[str, list[str]]] = []
    start, target = 0, rng.randint(*chunking.doc_words)
    while len(words) - start >= target:
        doc = words[start : start + target]
        chunks, i = [], 0
        while i < len(doc):
            j = i + rng.randint(*chunking.chunk_words)
            if len(doc) - j < chunking.chunk_words[0]:  # too little left for a chunk of its own
                j = len(doc)
            chunks.append(" ".join(doc[i:j]))
            i = j
        out.append((" ".join(doc), chunks))
        start, target = start + target, rng.randint(*chunking.doc_words)
    if not out:
        raise ValueError(
            f"embed-chunks: {dataset.source} holds {len(words)} words of passages, fewer than one document "
            f"({target} words drawn from doc_words {chunking.doc_words[0]}-{chunking.doc_words[1]}); "
            "raise --queries or lower --doc-words")
    return out

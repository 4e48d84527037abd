"""Domain results of the service layer and the answer shaping every dialect shares.

A route gets one of these and renders it: ``Embeddings`` (vectors already cut to ``dimensions``
and normalized as asked), ``Scores`` (raw reranker scores, with their sigmoid relevance and the
ranking), ``Similarities`` and ``TokenStates``. ``Usage`` carries the input tokens and the
timings every inference answer reports in its ``x-*-time`` headers. Shaping rules live here once:
Matryoshka truncation before L2 normalization; relevance = sigmoid(raw); rankings sort by score,
descending, ties in input order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np



@dataclass(frozen=True)
class Usage:
    """Input tokens of one request and where its time went."""

    tokens: int  # input tokens sent to the model (prompt and template included)
    queue_s: float
    inference_s: float
    total_s: float
    compute_tokens: int  # tokens computed (prefix-cache hits excluded)

    def headers(self) -> dict[str, str]:
        """The timing headers every inference answer carries."""
        return {
            "x-queue-time": _ms(self.queue_s),
            "x-inference-time": _ms(self.inference_s),
            "x-total-time": _ms(self.total_s),
            "x-compute-tokens": str(int(self.compute_tokens)),
        }


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray  # [B, d] float32, cut and normalized as the request asked
    usage: Usage


@dataclass(frozen=True)
class Scores:
    raw: list[float]  # logit("yes") - logit("no") per document, in input order
    usage: Usage

    def relevance(self) -> list[float]:
        return [sigmoid(s) for s in self.raw]


@dataclass(frozen=True)
class Similarities:
    values: list[float]  # cosine of the source sentence with each sentence
    usage: Usage


@dataclass(frozen=True)
class TokenStates:
    states: list  # per input: float32 [L, E] final hidden states (after the final norm)
    usage: Usage


def shape_vectors(pooled: Sequence, *, dimensions: int | None, normalize: bool) -> np.ndarray:
    """[B, E] pooled states -> [B, d]: truncate to ``dimensions`` first, then L2-normalize."""
    if len(pooled) == 1:  # a lone input (the common query): no stack
        emb = np.asarray(pooled[0], dtype=np.float32)[None]  # [1, E]
    else:
        emb = np.stack([np.asarray(v, dtype=np.float32) for v in pooled])  # [B, E]
    if normalize:
        return l2_normalize(emb, dimensions)
    return emb[:, :dimensions]


def l2_normalize(emb: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """Matryoshka on the host: truncate [B, E] to ``dimensions``, then L2-normalize; numpy only
    (``models.pooling.normalize``'s numpy branch), so a front-end process never imports torch."""
    if dimensions is not None:
        if dimensions <= 0 or dimensions > emb.shape[-1]:
            raise ValueError(f"dimensions must be in 1..{emb.shape[-1]}, got {dimensions}")
        emb = emb[..., :dimensions]
    emb = np.asarray(emb, dtype=np.float32)
    # NOTE: what np.linalg.norm(emb, axis=-1) computes (in float32), without its generic dispatch
    norm = np.sqrt(np.add.reduce(emb * emb, axis=-1, keepdims=True))  # [B, 1]
    return emb / np.maximum(norm, 1e-12)


def cosines(pooled: Sequence) -> list[float]:
    """Cosine of item 0 with each of items 1.. (pooled states, unnormalized)."""
    emb = l2_normalize(np.stack([np.asarray(v, dtype=np.float32) for v in pooled]))  # [1+S, E]
    return (emb[1:] @ emb[0]).tolist()


def sigmoid(x: float) -> float:
    # NOTE: split by sign so large |x| neither overflows exp nor loses the tail.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def ranked(scores: Sequence[float]) -> list[int]:
    """Indices by score, descending; stable, so ties keep input order."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def _ms(seconds: float) -> str:
    return str(int(round(seconds * 1000)))

"""Infinity's bodies: its /rerank answer shape.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, StrictBool

from server.schemas.common import DocumentsBody
from server.schemas.openai import OpenAIUsage


class InfinityRerankRequest(DocumentsBody):
    return_documents: StrictBool = False
    raw_scores: StrictBool = False


class InfinityRerankResult(BaseModel):
    relevance_score: float
    index: int
    document: str | None = None


class InfinityRerankResponse(BaseModel):
    """Infinity's rerank answer: a returned document is a plain string."""

    object: Literal["rerank"] = "rerank"
    results: list[InfinityRerankResult]
    model: str
    usage: OpenAIUsage
    id: str
    created: int

"""Infinity's answer shapes, shared by its routes (server/routes/infinity.py) and TEI's /rerank,
which answers a ``documents`` body as Infinity does when Infinity's routes are at the root
(``--url-prefix /``, what Infinity's launch line gives by default).

Read from Infinity's own response models (libs/infinity_emb/infinity_emb/fastapi_schemas/
pymodels.py): a rerank answer is {object: "rerank", results: [{relevance_score, index,
document?}], model, usage: {prompt_tokens, total_tokens}, id, created}, a returned document a plain
string; a model is {id, stats, object: "model", owned_by: "infinity", created, backend,
capabilities}, where Infinity's client refuses any other ``owned_by`` and needs ``stats``.
"""
from __future__ import annotations

import time
import uuid
from typing import Sequence

from server.service.results import ranked


def rerank_answer(scores: Sequence[float], texts: Sequence[str], *, top_n: int | None, return_documents: bool,
                  model: str, tokens: int) -> dict:
    """Infinity's rerank answer: results by relevance, descending (ties in input order), cut to ``top_n``."""
    results = []
    for i in ranked(scores)[:top_n]:
        item: dict = {"relevance_score": scores[i], "index": i}
        if return_documents:
            item["document"] = texts[i]
        results.append(item)
    return {"object": "rerank", "results": results, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "id": f"infinity-{uuid.uuid4()}", "created": int(time.time())}


def model_record(model: str, *, capability: str, created: int, stats: dict) -> dict:
    """One entry of Infinity's GET /models list."""
    return {"id": model, "stats": stats, "object": "model", "owned_by": "infinity", "created": created,
            "backend": "torch", "capabilities": [capability]}

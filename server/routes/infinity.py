"""Infinity's dialect: POST /infinity/rerank, and GET /models (also /infinity/models).

Infinity answers a returned document as a plain string (``"document": "text"``), where Cohere,
Jina and vLLM answer an object (``"document": {"text": "text"}``), for the same request body on
the same route names; litellm's ``infinity/`` provider parses only the string, its ``cohere/``,
``hosted_vllm/`` and the Cohere SDK only the object, and their requests are byte-for-byte alike.
So /rerank and /v1/rerank keep the object, and Infinity's clients point their base URL at
``/infinity`` (litellm: ``api_base=http://host:8080/infinity``), the way Infinity's own
``--url-prefix`` moves its routes. Answer: {object: "rerank", results: [{relevance_score, index,
document?}], model, usage: {prompt_tokens, total_tokens}, id, created}, sorted by relevance,
descending (ties in input order), cut to ``top_n``; ``raw_scores`` answers the raw logit
difference instead of its sigmoid. /models answers Infinity's list: OpenAI's model objects with
its ``backend`` and ``capabilities`` (``embed`` or ``rerank``: what the loaded model serves), which
its client reads to pick a model.
"""
from __future__ import annotations

import time
import uuid
from enum import Enum

from fastapi import APIRouter, Request, Response

from server.http.bodies import openapi_body, parse_body
from server.schemas.infinity import InfinityRerankRequest, InfinityRerankResponse
from server.service.core import Service
from server.service.encoding import RECORD_VALUES, dumps, json_answer, render
from server.service.results import ranked

PREFIX = "/infinity"


class InfinityRoutes:
    """The Infinity handlers of one app, bound to its service and the served model name."""

    def __init__(self, service: Service, *, model_name: str) -> None:
        self.service = service
        self.model_name = model_name
        self.max_items = service.limits.max_client_batch_size
        capability = "rerank" if service.runner.kind == "reranker" else "embed"
        self.model = {"id": model_name, "object": "model", "owned_by": "radixserve", "created": int(time.time()),
                      "backend": "torch", "capabilities": [capability], "stats": {}}

    async def models(self) -> dict:
        """Infinity's model list: the one served model and what it can do."""
        return {"object": "list", "data": [self.model]}

    async def rerank(self, request: Request) -> Response:
        """Infinity rerank: query + documents -> {object, results[{relevance_score, index, document?}], ...}."""
        service = self.service
        call = service.begin("infinity_rerank")
        service.require("reranker", request.url.path)
        body = await parse_body(request, InfinityRerankRequest, max_items=self.max_items)
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        service.check_inputs(len(texts), query=body.query, what="documents")
        result = await service.rerank(request, call, body.query, texts, instruction=service.runner.rerank_instruction,
                                      truncate=service.truncate(None), direction="right")

        def build() -> bytes:
            scores = result.raw if body.raw_scores else result.relevance()
            results = []
            for i in ranked(scores)[: body.top_n]:
                item: dict = {"relevance_score": scores[i], "index": i}
                if body.return_documents:
                    item["document"] = texts[i]
                results.append(item)
            tokens = result.usage.tokens
            return dumps({"object": "rerank", "results": results, "model": self.model_name,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                          "id": f"infinity-{uuid.uuid4()}", "created": int(time.time())})

        return json_answer(await render(build, weight=RECORD_VALUES * len(texts)), result.usage.headers())


def build_router(service: Service, *, model_name: str) -> APIRouter:
    infinity = InfinityRoutes(service, model_name=model_name)
    router = APIRouter()
    tags: list[str | Enum] = ["Infinity"]
    router.add_api_route(f"{PREFIX}/rerank", infinity.rerank, methods=["POST"], response_model=InfinityRerankResponse,
                         tags=tags, openapi_extra=openapi_body(InfinityRerankRequest))
    for path in ("/models", f"{PREFIX}/models"):
        router.add_api_route(path, infinity.models, methods=["GET"], tags=tags, summary="Models (Infinity)")
    return router

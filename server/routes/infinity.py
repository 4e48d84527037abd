"""Infinity's dialect: POST /infinity/rerank, GET /models (also /infinity/models), POST
/infinity/embeddings (OpenAI's route, server/app.py), so ``base_url=http://host:8080/infinity``
serves Infinity's client whole; and, with ``--url-prefix P`` (Infinity's flag), its routes at P:
P/rerank, P/models and P/embeddings.

Infinity answers a returned document as a plain string (``"document": "text"``), where Cohere,
Jina and vLLM answer an object (``"document": {"text": "text"}``), for the same request body on
the same route names; litellm's ``infinity/`` provider and Infinity's client parse only the string,
its ``cohere/``, ``hosted_vllm/`` and the Cohere SDK only the object, and their requests are
byte-for-byte alike. So without ``--url-prefix`` /rerank and /v1/rerank keep the object, and
Infinity's clients point their base URL at ``/infinity``. With it, the prefix is Infinity's, as on
Infinity's own server: under ``--url-prefix /v1`` /v1/rerank and /v1/models answer Infinity's
shapes (server/app.py gives them precedence over Cohere's /v1/rerank and OpenAI's /v1/models;
OpenAI's SDK reads Infinity's model list, a superset of its own), and /v1/embeddings is OpenAI's,
which is Infinity's; under ``--url-prefix /`` (Infinity's launch line's default) TEI's /rerank
answers a ``documents`` body in Infinity's shape (server/routes/tei.py). Rerank answer:
{object: "rerank", results: [{relevance_score, index, document?}], model, usage: {prompt_tokens,
total_tokens}, id, created}, sorted by relevance, descending (ties in input order), cut to
``top_n``; ``raw_scores`` answers the raw logit difference instead of its sigmoid. /models answers
Infinity's list (server/service/infinity_answers.py): ``owned_by`` "infinity" (its client accepts
no other), ``stats`` as Infinity fills them (queue_fraction: permits in use over all permits,
queue_absolute: requests waiting for the model, results_pending: input items admitted,
batch_size: --max-batch-requests), ``backend`` and ``capabilities`` (``embed`` or ``rerank``:
what the loaded model serves), which its client reads to pick a model.
"""
from __future__ import annotations

import time
from enum import Enum

from fastapi import APIRouter, Request, Response

from server.http.bodies import openapi_body, parse_body
from server.schemas.infinity import InfinityRerankRequest, InfinityRerankResponse
from server.service.core import Service
from server.service.encoding import RECORD_VALUES, dumps, json_answer, render
from server.service.infinity_answers import model_record, rerank_answer

PREFIX = "/infinity"


class InfinityRoutes:
    """The Infinity handlers of one app, bound to its service and the served model name."""

    def __init__(self, service: Service, *, model_name: str, batch_size: int) -> None:
        self.service = service
        self.model_name = model_name
        self.batch_size = batch_size
        self.max_items = service.limits.max_client_batch_size
        self.capability = "rerank" if service.runner.kind == "reranker" else "embed"
        self.created = int(time.time())

    async def models(self) -> dict:
        """Infinity's model list: the one served model, what it can do and how busy it is."""
        permits = self.service.permits
        stats = {"queue_fraction": permits.in_use / permits.total, "queue_absolute": self.service.scheduler.queue_size,
                 "results_pending": permits.in_use, "batch_size": self.batch_size}
        return {"object": "list", "data": [model_record(self.model_name, capability=self.capability,
                                                        created=self.created, stats=stats)]}

    async def rerank(self, request: Request) -> Response:
        """Infinity rerank: query + documents -> {object, results[{relevance_score, index, document?}], ...}."""
        service = self.service
        call = service.begin("infinity_rerank")
        service.require("reranker", request.scope["path"])
        body = await parse_body(request, InfinityRerankRequest, max_items=self.max_items)
        service.check_model(body.model)
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        service.check_inputs(len(texts), query=body.query, what="documents")
        result = await service.rerank(request, call, body.query, texts, instruction=service.runner.rerank_instruction,
                                      truncate=service.truncate(None), direction="right")

        def build() -> bytes:
            return dumps(rerank_answer(result.raw if body.raw_scores else result.relevance(), texts, top_n=body.top_n,
                                       return_documents=body.return_documents, model=self.model_name,
                                       tokens=result.usage.tokens))

        return json_answer(await render(build, weight=RECORD_VALUES * len(texts)), result.usage.headers())


def routes_at(prefix: str | None) -> tuple[str, ...]:
    """The prefixes Infinity's rerank and models routes live at: /infinity always, and --url-prefix's
    (the root's /rerank is TEI's, which answers Infinity's way there: see the module docstring)."""
    return (PREFIX,) if prefix in (None, "", "/", PREFIX) else (prefix, PREFIX)


def build_router(service: Service, *, model_name: str, batch_size: int, prefix: str | None = None) -> APIRouter:
    """``prefix``: --url-prefix (None: unset). Its routes come first, so server/app.py can give them
    precedence over another dialect's at the same path."""
    infinity = InfinityRoutes(service, model_name=model_name, batch_size=batch_size)
    router = APIRouter()
    tags: list[str | Enum] = ["Infinity"]
    for at in routes_at(prefix):
        router.add_api_route(f"{at}/rerank", infinity.rerank, methods=["POST"], response_model=InfinityRerankResponse,
                             tags=tags, openapi_extra=openapi_body(InfinityRerankRequest))
    for path in ("/models", *(f"{at}/models" for at in routes_at(prefix))):
        router.add_api_route(path, infinity.models, methods=["GET"], tags=tags, summary="Models (Infinity)")
    return router

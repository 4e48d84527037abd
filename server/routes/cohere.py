"""Cohere's and Jina's dialect: POST /v1/rerank (Cohere v1 and Jina), POST /v1/embed, /v2/embed and
/v2/rerank (Cohere's Client and ClientV2).

Rerank answers sort by relevance (sigmoid of the raw score), descending, ties in input order;
``top_n`` applies after sorting.

Embed answers (input_type -> prompt, normalization, embedding types) are built by
server/service/cohere_embed.py, which TEI's POST / shares.
"""
from __future__ import annotations

import uuid
from enum import Enum

from fastapi import APIRouter, Request, Response

from server.http.bodies import openapi_body, parse_body
from server.schemas.cohere import CohereRerankRequest, CohereRerankResponse
from server.schemas.cohere import CohereEmbedRequest, CohereEmbedResponse, CohereV2RerankRequest, CohereV2RerankResponse
from server.service.core import Call, Service
from server.service.encoding import RECORD_VALUES, dumps, json_answer, render
from server.service.cohere_embed import answer_cohere_embed, cohere_meta
from server.service.results import Usage, ranked


class CohereRoutes:
    """The Cohere/Jina handlers of one app, bound to its service and the served model name."""

    def __init__(self, service: Service, *, model_name: str) -> None:
        self.service = service
        self.model_name = model_name
        self.max_items = service.limits.max_client_batch_size

    async def embed(self, request: Request, *, version: str) -> Response:
        call = self.service.begin(f"cohere_embed_v{version}")
        self.service.require("embedding", request.scope["path"])
        body = await parse_body(request, CohereEmbedRequest, max_items=self.max_items)
        return await answer_cohere_embed(self.service, request, body, call, version=version)

    async def embed_v1(self, request: Request) -> Response:
        """Cohere v1 embed: texts, input_type, embedding_types (float/base64), output_dimension."""
        return await self.embed(request, version="1")

    async def embed_v2(self, request: Request) -> Response:
        """Cohere v2 embed: as v1, answering embeddings by type (float unless embedding_types says)."""
        return await self.embed(request, version="2")

    async def relevance(self, request: Request, call: Call, query: str,
                        documents: list[str]) -> tuple[list[int], list[float], Usage]:
        """Documents ranked by relevance to ``query``: (order, relevance by input index, usage)."""
        # NOTE: an empty document is scored (its templated input is not empty); an empty query is not.
        self.service.check_inputs(len(documents), query=query, what="documents")
        result = await self.service.rerank(
            request, call, query, documents, instruction=self.service.runner.rerank_instruction,
            truncate=self.service.truncate(None), direction="right",
        )

        def rank() -> tuple[list[int], list[float], Usage]:
            scores = result.relevance()
            return ranked(scores), scores, result.usage

        return await render(rank, weight=RECORD_VALUES * len(documents))

    async def rerank_v1(self, request: Request) -> Response:
        """Cohere/Jina rerank: query + documents ([str] or [{text}]) -> {model, results, usage}."""
        call = self.service.begin("cohere_rerank")
        self.service.require("reranker", "/v1/rerank")
        body = await parse_body(request, CohereRerankRequest, max_items=self.max_items)
        self.service.check_model(body.model)
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        order, scores, usage = await self.relevance(request, call, body.query, texts)

        def build() -> bytes:
            results = []
            for i in order[: body.top_n]:
                item: dict = {"index": i, "relevance_score": scores[i]}
                if body.return_documents:
                    item["document"] = {"text": texts[i]}
                results.append(item)
            return dumps({"model": self.model_name, "results": results, "usage": {"total_tokens": usage.tokens}})

        return json_answer(await render(build, weight=RECORD_VALUES * len(texts)), usage.headers())

    async def rerank_v2(self, request: Request) -> Response:
        """Cohere v2 rerank: query + documents -> {id, results[{index, relevance_score}], meta}."""
        call = self.service.begin("cohere_rerank_v2")
        self.service.require("reranker", "/v2/rerank")
        body = await parse_body(request, CohereV2RerankRequest, max_items=self.max_items)
        self.service.check_model(body.model)
        order, scores, usage = await self.relevance(request, call, body.query, body.documents)

        def build() -> bytes:
            results = [{"index": i, "relevance_score": scores[i]} for i in order[: body.top_n]]
            return dumps({"id": str(uuid.uuid4()), "results": results, "meta": cohere_meta("2", search_units=1)})

        return json_answer(await render(build, weight=RECORD_VALUES * len(order)), usage.headers())


def build_router(service: Service, *, model_name: str) -> APIRouter:
    cohere = CohereRoutes(service, model_name=model_name)
    router = APIRouter()
    tags: list[str | Enum] = ["Cohere/Jina"]
    router.add_api_route("/v1/rerank", cohere.rerank_v1, methods=["POST"], response_model=CohereRerankResponse,
                         tags=tags, openapi_extra=openapi_body(CohereRerankRequest))
    documented = openapi_body(CohereEmbedRequest)
    router.add_api_route("/v1/embed", cohere.embed_v1, methods=["POST"], response_model=CohereEmbedResponse,
                         tags=tags, openapi_extra=documented)
    router.add_api_route("/v2/embed", cohere.embed_v2, methods=["POST"], response_model=CohereEmbedResponse,
                         tags=tags, openapi_extra=documented)
    router.add_api_route("/v2/rerank", cohere.rerank_v2, methods=["POST"], response_model=CohereV2RerankResponse,
                         tags=tags, openapi_extra=openapi_body(CohereV2RerankRequest))
    return router

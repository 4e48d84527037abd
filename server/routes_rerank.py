"""Rerank routes: TEI's POST /rerank and Cohere/Jina's POST /v1/rerank.

The runner returns raw scores logit("yes") - logit("no"); the relevance is their sigmoid. Both
routes answer sorted by score, descending (ties keep input order); /v1/rerank applies top_n
after sorting. An empty document is scored like any other (its templated input is not empty);
an empty query or an empty list is 400.
"""
from __future__ import annotations

import math

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from models import prompts
from server.bodies import openapi_body, parse_body
from server.schemas import CohereRerankRequest, CohereRerankResponse, Rank, RerankRequest
from server.service import Service


def sigmoid(x: float) -> float:
    # NOTE: split by sign so large |x| neither overflows exp nor loses the tail.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def ranked(scores: list[float]) -> list[int]:
    """Indices by score, descending; stable, so ties keep input order."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])


async def run(service: Service, request: Request, *, method: str, start: float, query: str, texts: list[str],
              truncate: bool, direction: str, instruction: str):
    """Admit, encode (query once) and score ``texts`` against ``query``: raw scores in ``outputs``."""
    async def make_items():
        return await service.tok.rerank_inputs(
            query, texts, instruction=instruction, truncate=truncate, direction=direction
        )

    return await service.serve(request, method=method, start=start, n_items=len(texts), make_items=make_items)


async def serve_rerank(service: Service, request: Request, body: RerankRequest, *, start: float) -> JSONResponse:
    """/rerank's answer to a parsed body (also reached through POST / and /invocations)."""
    service.check_inputs(len(body.texts), empty=body.query == "", what="texts")
    served = await run(
        service, request, method="rerank", start=start, query=body.query, texts=body.texts,
        truncate=service.truncate(body.truncate), direction=body.truncation_direction,
        instruction=body.instruction if body.instruction is not None else prompts.DEFAULT_INSTRUCTION,
    )
    raw = [float(s) for s in served.outputs]
    scores = raw if body.raw_scores else [sigmoid(s) for s in raw]
    out = []
    for i in ranked(scores):
        item = {"index": i, "score": scores[i]}
        if body.return_text:
            item["text"] = body.texts[i]
        out.append(item)
    return JSONResponse(out, headers=served.headers)


def build_router(service: Service, *, model_name: str) -> APIRouter:
    router = APIRouter()
    max_items = service.limits.max_client_batch_size

    @router.post("/rerank", response_model=list[Rank], tags=["TEI"], openapi_extra=openapi_body(RerankRequest))
    async def rerank(request: Request) -> JSONResponse:
        """TEI rerank: query + texts -> [{index, score, text?}] by score, descending."""
        start = service.count("rerank")
        service.require("reranker", "/rerank")
        body = await parse_body(request, RerankRequest, max_items=max_items)
        return await serve_rerank(service, request, body, start=start)

    @router.post(
        "/v1/rerank", response_model=CohereRerankResponse, tags=["Cohere/Jina"],
        openapi_extra=openapi_body(CohereRerankRequest),
    )
    async def rerank_v1(request: Request) -> JSONResponse:
        """Cohere/Jina rerank: query + documents ([str] or [{text}]) -> {model, results, usage}."""
        start = service.count("cohere_rerank")
        service.require("reranker", "/v1/rerank")
        body = await parse_body(request, CohereRerankRequest, max_items=max_items)
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        service.check_inputs(len(texts), empty=body.query == "", what="documents")
        served = await run(
            service, request, method="cohere_rerank", start=start, query=body.query, texts=texts,
            truncate=service.truncate(None), direction="right", instruction=prompts.DEFAULT_INSTRUCTION,
        )
        scores = [sigmoid(float(s)) for s in served.outputs]
        order = ranked(scores)[: body.top_n]
        results = []
        for i in order:
            item = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                item["document"] = {"text": texts[i]}
            results.append(item)
        payload = {"model": model_name, "results": results, "usage": {"total_tokens": served.n_tokens}}
        return JSONResponse(payload, headers=served.headers)

    return router

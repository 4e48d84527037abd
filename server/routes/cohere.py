"""Cohere's and Jina's dialect: POST /v1/rerank (Cohere v1 and Jina), POST /v1/embed, /v2/embed and
/v2/rerank (Cohere's Client and ClientV2).

Rerank answers sort by relevance (sigmoid of the raw score), descending, ties in input order;
``top_n`` applies after sorting.

input_type -> prompt (an embedding model's sentence-transformers prompts):
- search_query: the prompt named "query" (Qwen3-Embedding's instruction), else the server default;
- search_document: the prompt named "document" (Qwen3-Embedding's is empty), else none;
- classification / clustering: the prompt of that name if the model defines one, else the
  document prompt: both are symmetric tasks (every text plays the same role), and a web-search
  query instruction on both sides would skew them;
- absent: the server's default prompt, exactly as POST /embed with no prompt_name.
Vectors are L2-normalized (as /embed's default and Cohere's own); ``output_dimension`` truncates
first (Matryoshka). Embedding types: float and base64 (little-endian float32 bytes); the
quantized types are refused with a 422 that says so.
"""
from __future__ import annotations

import uuid
from enum import Enum

import orjson

from fastapi import APIRouter, Request, Response

from server.http.bodies import openapi_body, parse_body
from server.http.errors import ApiError
from server.routes.schemas import CohereRerankRequest, CohereRerankResponse
from server.routes.schemas_compat import (CohereEmbedRequest, CohereEmbedResponse, CohereV2RerankRequest,
                                          CohereV2RerankResponse)
from server.service.core import Call, Service
from server.service.encoding import RECORD_VALUES, base64_rows, dumps, float_array, json_answer, render
from server.service.results import Embeddings, Usage, ranked

SUPPORTED_TYPES = ("float", "base64")
QUANTIZED_TYPES = ("int8", "uint8", "binary", "ubinary")
# Cohere's truncate -> (truncate, direction): END cuts the end (our right), START the start.
TRUNCATE = {"END": (True, "right"), "START": (True, "left"), "NONE": (False, "right")}


def input_type_prompt(service: Service, input_type: str | None) -> str:
    """The prompt text for a Cohere input_type (see the module docstring)."""
    named = service.runner.prompts or {}
    if input_type is None:
        return service.resolve_prompt(None)
    if input_type == "image":
        raise ApiError("validation", "input_type 'image' is not supported: this server embeds text")
    if input_type == "search_query":
        return named["query"] if "query" in named else service.resolve_prompt(None)
    if input_type in ("classification", "clustering") and input_type in named:
        return named[input_type]
    return named.get("document", "")


def _check_types(types: list[str] | None, *, default: list[str] | None) -> list[str] | None:
    types = default if types is None else types
    if types is None:
        return None
    if not types:
        raise ApiError("validation", "embedding_types must not be empty")
    for t in types:
        if t in QUANTIZED_TYPES:
            raise ApiError("validation", f"embedding_types {t!r} is not supported; use 'float' or 'base64'")
        if t not in SUPPORTED_TYPES:
            raise ApiError("validation", f"unknown embedding_types {t!r}; supported: 'float', 'base64'")
    return list(dict.fromkeys(types))


def _meta(version: str, **billed) -> dict:
    return {"api_version": {"version": version}, "billed_units": billed}


def by_type(result: Embeddings, types: list[str] | None) -> dict:
    """v1 without embedding_types answers the plain float list; otherwise embeddings by type.

    Float arrays come encoded (``orjson.Fragment``): the caller renders with ``encoding.dumps``."""
    if types is None:
        return {"response_type": "embeddings_floats", "embeddings": orjson.Fragment(float_array(result.vectors))}
    embeddings: dict = {}
    if "float" in types:
        embeddings["float"] = orjson.Fragment(float_array(result.vectors))
    if "base64" in types:
        embeddings["base64"] = base64_rows(result.vectors)
    return {"response_type": "embeddings_by_type", "embeddings": embeddings}


class CohereRoutes:
    """The Cohere/Jina handlers of one app, bound to its service and the served model name."""

    def __init__(self, service: Service, *, model_name: str) -> None:
        self.service = service
        self.model_name = model_name
        self.max_items = service.limits.max_client_batch_size

    async def embed(self, request: Request, *, version: str) -> Response:
        call = self.service.begin(f"cohere_embed_v{version}")
        self.service.require("embedding", request.url.path)
        body = await parse_body(request, CohereEmbedRequest, max_items=self.max_items)
        return await self.answer_embed(request, body, call, version=version)

    async def answer_embed(self, request: Request, body: CohereEmbedRequest, call: Call, *,
                           version: str) -> Response:
        """Cohere's embed answer to a parsed body (also POST / given Cohere's body: server/routes/tei.py)."""
        service = self.service
        if body.images is not None or body.inputs is not None:
            raise ApiError("validation", "images and inputs are not supported; send texts")
        if body.texts is None:
            raise ApiError("validation", "texts is required")
        texts = body.texts
        service.check_inputs(len(texts), empty=any(t == "" for t in texts), what="texts")
        service.check_dimensions(body.output_dimension)
        # v1 without embedding_types answers the plain float list; v2 always answers by type.
        types = _check_types(body.embedding_types, default=["float"] if version == "2" else None)
        prompt = input_type_prompt(service, body.input_type)
        truncate, direction = TRUNCATE[body.truncate] if body.truncate else (service.truncate(None), "right")
        result = await service.embed(request, call, texts, prompt=prompt, truncate=truncate, direction=direction,
                                     dimensions=body.output_dimension, normalize=True)
        meta = _meta(version, input_tokens=result.usage.tokens)

        def build() -> bytes:
            return dumps({"id": str(uuid.uuid4()), "texts": texts, "meta": meta, **by_type(result, types)})

        return json_answer(await render(build, weight=result.vectors.size), result.usage.headers())

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
        order, scores, usage = await self.relevance(request, call, body.query, body.documents)

        def build() -> bytes:
            results = [{"index": i, "relevance_score": scores[i]} for i in order[: body.top_n]]
            return dumps({"id": str(uuid.uuid4()), "results": results, "meta": _meta("2", search_units=1)})

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

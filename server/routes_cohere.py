"""Cohere's routes: POST /v1/embed, POST /v2/embed and POST /v2/rerank (Client and ClientV2).

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

import base64
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from models import prompts
from server.bodies import openapi_body, parse_body
from server.errors import ApiError
from server.routes_embed import finish, resolve_prompt
from server.routes_rerank import ranked, sigmoid
from server.schemas_compat import CohereEmbedRequest, CohereEmbedResponse, CohereV2RerankRequest, CohereV2RerankResponse
from server.service import Service

SUPPORTED_TYPES = ("float", "base64")
QUANTIZED_TYPES = ("int8", "uint8", "binary", "ubinary")
# Cohere's truncate -> (truncate, direction): END cuts the end (our right), START the start.
TRUNCATE = {"END": (True, "right"), "START": (True, "left"), "NONE": (False, "right")}


def input_type_prompt(service: Service, input_type: str | None) -> str:
    """The prompt text for a Cohere input_type (see the module docstring)."""
    named = service.runner.prompts or {}
    if input_type is None:
        return resolve_prompt(service, None)
    if input_type == "image":
        raise ApiError("validation", "input_type 'image' is not supported: this server embeds text")
    if input_type == "search_query":
        return named["query"] if "query" in named else resolve_prompt(service, None)
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


def build_router(service: Service) -> APIRouter:
    router = APIRouter()
    max_items = service.limits.max_client_batch_size

    async def embed(request: Request, *, version: str) -> JSONResponse:
        start = service.count(f"cohere_embed_v{version}")
        service.require("embedding", request.url.path)
        body = await parse_body(request, CohereEmbedRequest, max_items=max_items)
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

        async def make_items():
            return await service.tok.embedding_inputs(texts, prompt=prompt, truncate=truncate, direction=direction)

        served = await service.serve(
            request, method=f"cohere_embed_v{version}", start=start, n_items=len(texts), make_items=make_items
        )
        vectors = finish(served.outputs, dimensions=body.output_dimension, normalize=True)
        payload: dict = {"id": str(uuid.uuid4()), "texts": texts,
                         "meta": _meta(version, input_tokens=served.n_tokens)}
        if types is None:
            payload.update(response_type="embeddings_floats", embeddings=[v.tolist() for v in vectors])
        else:
            by_type: dict = {}
            if "float" in types:
                by_type["float"] = [v.tolist() for v in vectors]
            if "base64" in types:
                by_type["base64"] = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
            payload.update(response_type="embeddings_by_type", embeddings=by_type)
        return JSONResponse(payload, headers=served.headers)

    documented = openapi_body(CohereEmbedRequest)

    @router.post("/v1/embed", response_model=CohereEmbedResponse, tags=["Cohere/Jina"], openapi_extra=documented)
    async def embed_v1(request: Request) -> JSONResponse:
        """Cohere v1 embed: texts, input_type, embedding_types (float/base64), output_dimension."""
        return await embed(request, version="1")

    @router.post("/v2/embed", response_model=CohereEmbedResponse, tags=["Cohere/Jina"], openapi_extra=documented)
    async def embed_v2(request: Request) -> JSONResponse:
        """Cohere v2 embed: as v1, answering embeddings by type (float unless embedding_types says)."""
        return await embed(request, version="2")

    @router.post("/v2/rerank", response_model=CohereV2RerankResponse, tags=["Cohere/Jina"],
                 openapi_extra=openapi_body(CohereV2RerankRequest))
    async def rerank_v2(request: Request) -> JSONResponse:
        """Cohere v2 rerank: query + documents -> {id, results[{index, relevance_score}], meta}."""
        start = service.count("cohere_rerank_v2")
        service.require("reranker", "/v2/rerank")
        body = await parse_body(request, CohereV2RerankRequest, max_items=max_items)
        # NOTE: an empty document is scored (its templated input is not empty); an empty query is not.
        service.check_inputs(len(body.documents), empty=body.query == "", what="documents")
        truncate = service.truncate(None)

        async def make_items():
            return await service.tok.rerank_inputs(
                body.query, body.documents, instruction=prompts.DEFAULT_INSTRUCTION, truncate=truncate,
                direction="right",
            )

        served = await service.serve(
            request, method="cohere_rerank_v2", start=start, n_items=len(body.documents), make_items=make_items
        )
        scores = [sigmoid(float(s)) for s in served.outputs]
        results = [{"index": i, "relevance_score": scores[i]} for i in ranked(scores)[: body.top_n]]
        payload = {"id": str(uuid.uuid4()), "results": results, "meta": _meta("2", search_units=1)}
        return JSONResponse(payload, headers=served.headers)

    return router

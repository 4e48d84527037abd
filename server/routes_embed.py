"""Embedding routes: TEI's POST /embed and OpenAI's POST /v1/embeddings (alias /embeddings).

The runner returns pooled hidden states, unnormalized; here Matryoshka ``dimensions`` keeps the
first n values and only then is the vector L2-normalized (OpenAI always normalizes; TEI unless
normalize=false). base64 is the little-endian float32 bytes, which the OpenAI SDK decodes.
"""
from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from models import pooling, prompts
from server.bodies import openapi_body, parse_body
from server.errors import ApiError
from server.schemas import EmbedRequest, OpenAIEmbeddingRequest, OpenAIEmbeddingResponse
from server.service import Service


def finish(vectors: list, *, dimensions: int | None, normalize: bool) -> np.ndarray:
    """[B, E] pooled states -> [B, d]: truncate to ``dimensions`` first, then L2-normalize."""
    emb = np.stack([np.asarray(v, dtype=np.float32) for v in vectors])  # [B, E]
    if normalize:
        return pooling.normalize(emb, dimensions)
    return emb[:, :dimensions]


def resolve_prompt(service: Service, prompt_name: str | None) -> str:
    try:
        return prompts.resolve_prompt(
            service.runner.prompts or {},
            prompt_name=prompt_name,
            default_prompt_name=service.default_prompt_name,
            default_prompt=service.default_prompt,
        )
    except prompts.UnknownPrompt as exc:
        raise ApiError("validation", str(exc)) from exc


async def serve_embed(service: Service, request: Request, body: EmbedRequest, *, start: float) -> JSONResponse:
    """/embed's answer to a parsed body (also reached through POST / and /invocations)."""
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    service.check_inputs(len(texts), empty=any(t == "" for t in texts))
    service.check_dimensions(body.dimensions)
    prompt = resolve_prompt(service, body.prompt_name)
    truncate = service.truncate(body.truncate)

    async def make_items():
        return await service.tok.embedding_inputs(
            texts, prompt=prompt, truncate=truncate, direction=body.truncation_direction
        )

    served = await service.serve(request, method="embed", start=start, n_items=len(texts), make_items=make_items)
    vectors = finish(served.outputs, dimensions=body.dimensions, normalize=body.normalize)
    return JSONResponse([v.tolist() for v in vectors], headers=served.headers)


def build_router(service: Service, *, model_name: str) -> APIRouter:
    router = APIRouter()

    max_items = service.limits.max_client_batch_size

    @router.post("/embed", response_model=list[list[float]], tags=["TEI"], openapi_extra=openapi_body(EmbedRequest))
    async def embed(request: Request) -> JSONResponse:
        """TEI embeddings: inputs str or [str] -> [[float]]."""
        start = service.count("embed")
        service.require("embedding", "/embed")
        body = await parse_body(request, EmbedRequest, max_items=max_items)
        return await serve_embed(service, request, body, start=start)

    async def openai_embeddings(request: Request) -> JSONResponse:
        """OpenAI embeddings: input str | [str] | [int] | [[int]] -> list object."""
        start = service.count("openai_embeddings")
        service.require("embedding", request.url.path)
        body = await parse_body(request, OpenAIEmbeddingRequest, max_items=max_items)
        raw = body.input
        if isinstance(raw, str):
            raw = [raw]
        if raw and isinstance(raw[0], int):
            raw = [raw]  # one pre-tokenized input
        empty = any(len(x) == 0 for x in raw)
        service.check_inputs(len(raw), empty=empty, what="input")
        service.check_dimensions(body.dimensions)
        truncate = service.truncate(None)
        if isinstance(raw[0], str):
            prompt = resolve_prompt(service, None)

            async def make_items():
                return await service.tok.embedding_inputs(raw, prompt=prompt, truncate=truncate, direction="right")
        else:
            ids = service.tok.check_token_ids(raw, truncate=truncate)

            async def make_items():
                return ids

        served = await service.serve(
            request, method="openai_embeddings", start=start, n_items=len(raw), make_items=make_items
        )
        vectors = finish(served.outputs, dimensions=body.dimensions, normalize=True)
        if body.encoding_format == "base64":
            data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        else:
            data = [v.tolist() for v in vectors]
        payload = {
            "object": "list",
            "data": [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(data)],
            "model": model_name,
            "usage": {"prompt_tokens": served.n_tokens, "total_tokens": served.n_tokens},
        }
        return JSONResponse(payload, headers=served.headers)

    documented = openapi_body(OpenAIEmbeddingRequest)
    router.add_api_route(
        "/v1/embeddings", openai_embeddings, methods=["POST"], response_model=OpenAIEmbeddingResponse,
        tags=["OpenAI"], openapi_extra=documented,
    )
    router.add_api_route(
        "/embeddings", openai_embeddings, methods=["POST"], response_model=OpenAIEmbeddingResponse,
        tags=["OpenAI"], include_in_schema=False,
    )
    return router

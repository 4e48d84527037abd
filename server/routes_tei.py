"""TEI's remaining routes: POST / and /invocations (dispatch), GET / and /ping, POST /similarity,
/embed_all and /decode.

POST / and POST /invocations (SageMaker's name) answer as the route that serves the body would:
/rerank for a reranker; for an embedding model /similarity when ``inputs`` is a JSON object
({source_sentence, sentences}), else /embed. The body is parsed once (server/bodies.py, with a
``pick`` on the parsed JSON) and handed to that route's own code, so answers, errors, metrics and
headers are exactly the target's. /embed_all answers each token's final hidden state (after the
final norm), read from the compact rows through the radix index's scatter: no uncompacted forward
is ever run for it. Its answer is E floats per token, so a request may hold at most as many tokens
as one /tokenize answer (max_batch_tokens).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Union

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from models import pooling
from server.bodies import openapi_body, parse_body
from server.errors import ApiError
from server.routes_embed import resolve_prompt, serve_embed
from server.routes_rerank import serve_rerank
from server.schemas import EmbedRequest, Rank, RerankRequest
from server.schemas_compat import DecodeRequest, EmbedAllRequest, SimilarityRequest
from server.service import Service

DISPATCHED = ("/", "/invocations")


def embedding_body(data: dict) -> type[EmbedRequest] | type[SimilarityRequest]:
    """POST / on an embedding model: /similarity's body when ``inputs`` is an object, else /embed's."""
    return SimilarityRequest if isinstance(data.get("inputs"), dict) else EmbedRequest


async def serve_similarity(service: Service, request: Request, body: SimilarityRequest, *,
                           start: float) -> JSONResponse:
    """Cosine similarity of source_sentence with each of sentences, from our embeddings."""
    params = body.parameters
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    if not body.inputs.sentences:
        raise ApiError("empty", "inputs.sentences must not be empty")
    service.check_inputs(len(texts), empty=any(t == "" for t in texts))
    prompt = resolve_prompt(service, params.prompt_name if params else None)
    truncate = service.truncate(params.truncate if params else None)
    direction = params.truncation_direction if params else "right"

    async def make_items():
        return await service.tok.embedding_inputs(texts, prompt=prompt, truncate=truncate, direction=direction)

    served = await service.serve(request, method="similarity", start=start, n_items=len(texts), make_items=make_items)
    emb = pooling.normalize(np.stack([np.asarray(v, dtype=np.float32) for v in served.outputs]))  # [1+S, E]
    return JSONResponse((emb[1:] @ emb[0]).tolist(), headers=served.headers)


def build_router(service: Service) -> APIRouter:
    router = APIRouter()
    max_items = service.limits.max_client_batch_size
    reranker = service.runner.kind == "reranker"

    async def healthy() -> Response:
        if not service.scheduler.alive:
            raise ApiError("unhealthy", "the model worker is not running")
        return Response(status_code=200)

    router.add_api_route("/ping", healthy, methods=["GET"], tags=["TEI"], summary="Health (SageMaker)")
    router.add_api_route("/", healthy, methods=["GET"], tags=["TEI"], summary="Health (Inference API)")

    async def dispatch(request: Request) -> Response:
        if reranker:
            start = service.count("rerank")
            body = await parse_body(request, RerankRequest, max_items=max_items)
            return await serve_rerank(service, request, body, start=start)
        start, body = time.perf_counter(), None
        try:
            body = await parse_body(request, EmbedRequest, max_items=max_items, pick=embedding_body)
        finally:  # NOTE: counted once the shape is known (a body that does not parse counts as embed)
            service.count("similarity" if isinstance(body, SimilarityRequest) else "embed")
        if isinstance(body, SimilarityRequest):
            return await serve_similarity(service, request, body, start=start)
        return await serve_embed(service, request, body, start=start)

    targets = "/rerank" if reranker else "/embed or /similarity"
    for path in DISPATCHED:
        router.add_api_route(
            path, dispatch, methods=["POST"], tags=["TEI"], summary=f"TEI compat: dispatch to {targets}",
            description=f"Served as {targets} would serve the same body (an embedding model takes /similarity's "
                        "body when `inputs` is an object)." + (" SageMaker's route." if path == "/invocations" else ""),
            response_model=list[Rank] if reranker else Union[list[list[float]], list[float]],
            openapi_extra=openapi_body(RerankRequest) if reranker else openapi_body(EmbedRequest, SimilarityRequest),
            operation_id=f"dispatch_{'root' if path == '/' else 'invocations'}_post",
        )

    @router.post("/similarity", response_model=list[float], tags=["TEI"],
                 openapi_extra=openapi_body(SimilarityRequest))
    async def similarity(request: Request) -> JSONResponse:
        """Cosine similarity of source_sentence with each of sentences, from our embeddings."""
        start = service.count("similarity")
        service.require("embedding", "/similarity")
        body = await parse_body(request, SimilarityRequest, max_items=max_items)
        return await serve_similarity(service, request, body, start=start)

    @router.post("/embed_all", response_model=list[list[list[float]]], tags=["TEI"],
                 openapi_extra=openapi_body(EmbedAllRequest))
    async def embed_all(request: Request) -> Response:
        """Every token's final hidden state (after the final norm, not normalized): [[[float]]]."""
        start = service.count("embed_all")
        service.require("embedding", "/embed_all")
        body = await parse_body(request, EmbedAllRequest, max_items=max_items)
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        service.check_inputs(len(texts), empty=any(t == "" for t in texts))
        prompt = resolve_prompt(service, body.prompt_name)
        truncate = service.truncate(body.truncate)
        cap = service.limits.max_display_tokens

        async def make_items():
            items = await service.tok.embedding_inputs(
                texts, prompt=prompt, truncate=truncate, direction=body.truncation_direction
            )
            n = sum(map(len, items))
            if n > cap:  # the answer holds E floats per token
                raise ApiError("validation", f"{n} tokens in one /embed_all request, more than the maximum of {cap}")
            return items

        served = await service.serve(
            request, method="embed_all", start=start, n_items=len(texts), make_items=make_items, all_tokens=True
        )
        # NOTE: L*E floats per input: render the JSON off the event loop.
        content = await asyncio.to_thread(lambda: json.dumps([o.tolist() for o in served.outputs]).encode())
        return Response(content, media_type="application/json", headers=served.headers)

    @router.post("/decode", response_model=list[str], tags=["TEI"], openapi_extra=openapi_body(DecodeRequest))
    async def decode(request: Request) -> JSONResponse:
        """Token ids -> text, one string per id list."""
        service.count("decode")
        body = await parse_body(request, DecodeRequest, max_items=max_items)
        batch = [body.ids] if not body.ids or isinstance(body.ids[0], int) else body.ids
        vocab = service.tok.vocab_size
        for i, ids in enumerate(batch):
            if ids and not (0 <= min(ids) and max(ids) < vocab):  # min/max run in C
                raise ApiError("validation", f"ids {i}: a token id lies outside the vocabulary [0, {vocab})")
        tok = service.tok.tokenizer
        with service.admitted(len(batch)):
            texts = await asyncio.get_running_loop().run_in_executor(
                service.tok.executor, lambda: tok.decode_batch(batch, skip_special_tokens=body.skip_special_tokens)
            )
        service.metrics.request_success.labels(method="decode").inc()
        return JSONResponse(texts)

    return router

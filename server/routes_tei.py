"""TEI's remaining routes: POST / and /invocations (dispatch), GET / and /ping, POST /similarity,
/embed_all and /decode.

POST / and POST /invocations are not handlers of their own: ``RootDispatch`` (an ASGI layer inside
the admission guard, so the API key and payload limit were already applied) rewrites the path to
the route that serves the body: /rerank for a reranker; /similarity for an embedding model when
``inputs`` is a JSON object ({source_sentence, sentences}), else /embed. The answer, errors,
metrics and headers are therefore exactly the target route's. /embed_all answers each token's
final hidden state (after the final norm), read from the compact rows through the radix index's
scatter: no uncompacted forward is ever run for it.
"""
from __future__ import annotations

import asyncio
import copy
import json

import numpy as np
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from models import pooling
from server.errors import ApiError
from server.routes_embed import resolve_prompt
from server.schemas_compat import DecodeRequest, EmbedAllRequest, SimilarityRequest
from server.service import Service

DISPATCHED = ("/", "/invocations")


def dispatch_targets(kind: str) -> tuple[str, ...]:
    """The routes POST / can land on for a model kind (first: the default)."""
    return ("/rerank",) if kind == "reranker" else ("/embed", "/similarity")


def _inputs_is_object(body: bytes) -> bool:
    try:
        doc = json.loads(body)
    except ValueError:
        return False  # the target route answers the 422 for malformed JSON
    return isinstance(doc, dict) and isinstance(doc.get("inputs"), dict)


class RootDispatch:
    """ASGI: POST / and /invocations -> the route for this model kind and body shape."""

    def __init__(self, app, *, kind: str) -> None:
        self.app = app
        self.kind = kind

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in DISPATCHED:
            await self.app(scope, receive, send)
            return
        if self.kind == "reranker":
            await self.app(_rewrite(scope, "/rerank"), receive, send)
            return
        chunks, more = [], True
        while more:  # NOTE: bounded: the guard outside already enforced the payload limit
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        # json.loads is proportional to the body: off the event loop.
        similarity = await asyncio.to_thread(_inputs_is_object, body)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(_rewrite(scope, "/similarity" if similarity else "/embed"), replay, send)


def _rewrite(scope: dict, path: str) -> dict:
    return {**scope, "path": path, "raw_path": path.encode()}


def document_dispatch(app: FastAPI, *, kind: str) -> None:
    """List POST / and /invocations in /openapi.json with the bodies of the routes they reach."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        paths = schema["paths"]
        ops = [paths[t]["post"] for t in dispatch_targets(kind) if t in paths]
        if not ops:
            return schema
        for route in DISPATCHED:
            op = copy.deepcopy(ops[0])
            if len(ops) > 1:
                bodies = [o["requestBody"]["content"]["application/json"]["schema"] for o in ops]
                answers = [o["responses"]["200"]["content"]["application/json"]["schema"] for o in ops]
                op["requestBody"]["content"]["application/json"]["schema"] = {"oneOf": bodies}
                op["responses"]["200"]["content"]["application/json"]["schema"] = {"oneOf": answers}
            op["summary"] = "TEI compat: dispatch to " + " or ".join(dispatch_targets(kind))
            op["description"] = (
                "Served as " + " or ".join(dispatch_targets(kind)) + " would serve the same body "
                "(an embedding model takes /similarity's body when `inputs` is an object). "
                + ("SageMaker's route." if route == "/invocations" else "")
            )
            op["operationId"] = f"dispatch_{'root' if route == '/' else 'invocations'}_post"
            paths.setdefault(route, {})["post"] = op
        return schema

    app.openapi = openapi


def build_router(service: Service) -> APIRouter:
    router = APIRouter()

    async def healthy() -> Response:
        if not service.scheduler.alive:
            raise ApiError("unhealthy", "the model worker is not running")
        return Response(status_code=200)

    router.add_api_route("/ping", healthy, methods=["GET"], tags=["TEI"], summary="Health (SageMaker)")
    router.add_api_route("/", healthy, methods=["GET"], tags=["TEI"], summary="Health (Inference API)")

    @router.post("/similarity", response_model=list[float], tags=["TEI"])
    async def similarity(body: SimilarityRequest, request: Request) -> JSONResponse:
        """Cosine similarity of source_sentence with each of sentences, from our embeddings."""
        start = service.count("similarity")
        service.require("embedding", "/similarity")
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

    @router.post("/embed_all", response_model=list[list[list[float]]], tags=["TEI"])
    async def embed_all(body: EmbedAllRequest, request: Request) -> Response:
        """Every token's final hidden state (after the final norm, not normalized): [[[float]]]."""
        start = service.count("embed_all")
        service.require("embedding", "/embed_all")
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        service.check_inputs(len(texts), empty=any(t == "" for t in texts))
        prompt = resolve_prompt(service, body.prompt_name)
        truncate = service.truncate(body.truncate)

        async def make_items():
            return await service.tok.embedding_inputs(
                texts, prompt=prompt, truncate=truncate, direction=body.truncation_direction
            )

        served = await service.serve(
            request, method="embed_all", start=start, n_items=len(texts), make_items=make_items, all_tokens=True
        )
        # NOTE: L*E floats per input: render the JSON off the event loop.
        content = await asyncio.to_thread(lambda: json.dumps([np.asarray(o).tolist() for o in served.outputs]).encode())
        return Response(content, media_type="application/json", headers=served.headers)

    @router.post("/decode", response_model=list[str], tags=["TEI"])
    async def decode(body: DecodeRequest) -> JSONResponse:
        """Token ids -> text, one string per id list."""
        service.count("decode")
        batch = [body.ids] if not body.ids or isinstance(body.ids[0], int) else body.ids
        if not batch:
            raise ApiError("empty", "ids must not be empty")
        if len(batch) > service.limits.max_client_batch_size:
            raise ApiError(
                "validation",
                f"{len(batch)} id lists in one request, more than the maximum of {service.limits.max_client_batch_size}",
            )
        vocab = service.tok.vocab_size
        for i, ids in enumerate(batch):
            if ids and not (0 <= min(ids) and max(ids) < vocab):  # min/max run in C
                raise ApiError("validation", f"ids {i}: a token id lies outside the vocabulary [0, {vocab})")
        tok = service.tok.tokenizer
        texts = await asyncio.get_running_loop().run_in_executor(
            service.tok.executor, lambda: tok.decode_batch(batch, skip_special_tokens=body.skip_special_tokens)
        )
        service.metrics.request_success.labels(method="decode").inc()
        return JSONResponse(texts)

    return router

"""OpenAI's dialect: POST /v1/embeddings (alias /embeddings), GET /v1/models and /v1/models/{id}.

Embeddings: input str | [str] | [int] | [[int]]; vectors are always L2-normalized, Matryoshka
``dimensions`` cut first; base64 is the little-endian float32 bytes, which the OpenAI SDK decodes.
Models: the id is --served-model-name (default: the model id); ``created`` is when the server
started, so a client that caches the list sees a restart. An unknown id answers 404 in OpenAI's
error shape (``NotFoundError`` in the SDK).
"""
from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from server.http.bodies import openapi_body, parse_body
from server.http.errors import ApiError
from server.routes.schemas import OpenAIEmbeddingRequest, OpenAIEmbeddingResponse
from server.routes.schemas_compat import OpenAIModel, OpenAIModelList
from server.service.core import Service
from server.service.encoding import base64_rows, dumps, float_records, json_answer, render, with_array
from server.service.results import Embeddings


def as_list(input: str | list[str] | list[int] | list[list[int]]) -> list:
    """``input``: one text or one pre-tokenized input -> a list of one; lists stay as they are."""
    if isinstance(input, str):
        return [input]
    if input and isinstance(input[0], int):
        return [input]
    return input


class OpenAIRoutes:
    """The OpenAI handlers of one app, bound to its service and the served model name."""

    def __init__(self, service: Service, *, model_name: str) -> None:
        self.service = service
        self.model_name = model_name
        self.model = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "radixserve"}

    async def openai_embeddings(self, request: Request) -> Response:
        """OpenAI embeddings: input str | [str] | [int] | [[int]] -> list object."""
        service = self.service
        call = service.begin("openai_embeddings")
        service.require("embedding", request.url.path)
        body = await parse_body(request, OpenAIEmbeddingRequest, max_items=service.limits.max_client_batch_size)
        raw = as_list(body.input)
        service.check_inputs(len(raw), empty=any(len(x) == 0 for x in raw), what="input")
        service.check_dimensions(body.dimensions)
        truncate = service.truncate(None)
        result: Embeddings
        if isinstance(raw[0], str):
            prompt = service.resolve_prompt(None)
            result = await service.embed(request, call, raw, prompt=prompt, truncate=truncate, direction="right",
                                         dimensions=body.dimensions, normalize=True)
        else:
            result = await service.embed_ids(request, call, raw, truncate=truncate, dimensions=body.dimensions,
                                             normalize=True)
        content = await render(lambda: self.render(result, encoding_format=body.encoding_format),
                               weight=result.vectors.size)
        return json_answer(content, result.usage.headers())

    def render(self, result: Embeddings, *, encoding_format: str) -> bytes:
        """The list object's JSON bytes (off the loop for a big answer: see the route)."""
        vectors = result.vectors

        def record(i: int, embedding) -> dict:
            return {"object": "embedding", "embedding": embedding, "index": i}

        if encoding_format == "base64":
            data = dumps([record(i, e) for i, e in enumerate(base64_rows(vectors))])
        else:
            data = float_records(vectors, record)
        tokens = result.usage.tokens
        return with_array({"object": "list", "data": None, "model": self.model_name,
                           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, "data", data)

    async def list_models(self) -> dict:
        """The one served model."""
        return {"object": "list", "data": [self.model]}

    async def get_model(self, model_id: str) -> dict:
        """The served model; any other id is 404."""
        if model_id != self.model_name:
            raise ApiError("not_found", f"The model '{model_id}' does not exist")
        return self.model


def build_router(service: Service, *, model_name: str) -> APIRouter:
    openai = OpenAIRoutes(service, model_name=model_name)
    router = APIRouter()
    router.add_api_route(
        "/v1/embeddings", openai.openai_embeddings, methods=["POST"], response_model=OpenAIEmbeddingResponse,
        tags=["OpenAI"], openapi_extra=openapi_body(OpenAIEmbeddingRequest),
    )
    router.add_api_route(
        "/embeddings", openai.openai_embeddings, methods=["POST"], response_model=OpenAIEmbeddingResponse,
        tags=["OpenAI"], include_in_schema=False,
    )
    router.add_api_route("/v1/models", openai.list_models, methods=["GET"], response_model=OpenAIModelList,
                         tags=["OpenAI"])
    router.add_api_route("/v1/models/{model_id:path}", openai.get_model, methods=["GET"], response_model=OpenAIModel,
                         tags=["OpenAI"])
    return router

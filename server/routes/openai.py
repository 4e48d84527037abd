"""OpenAI's dialect: POST /v1/embeddings (alias /embeddings), GET /v1/models and /v1/models/{id}.

Embeddings: input str | [str] | [int] | [[int]]; vectors are always L2-normalized, Matryoshka
``dimensions`` cut first (0, which Infinity's client always sends, is the full size); base64 is the
little-endian float32 bytes, which the OpenAI SDK decodes. ``model``: any name when the server
was started without --served-model-name (as TEI), else one it serves or a 404 ``model_not_found``
(as vLLM; server/service/model_names.py). Token ids are read as this model's
tokenizer's ids, so they are refused unless --allow-token-ids: LangChain's OpenAIEmbeddings sends
tiktoken's cl100k ids by default, which would embed other text without an error.
Models: the id is --served-model-name (default: the model id); ``created`` is when the server
started, so a client that caches the list sees a restart. An unknown id answers 404 in OpenAI's
error shape (``NotFoundError`` in the SDK).
"""
from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from server.http.bodies import openapi_body, parse_body
from server.http.errors import ApiError
from server.schemas.openai import OpenAIEmbeddingRequest, OpenAIEmbeddingResponse
from server.schemas.openai import OpenAIModel, OpenAIModelList
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

    def __init__(self, service: Service, *, model_name: str, allow_token_ids: bool = False) -> None:
        self.service = service
        self.allow_token_ids = allow_token_ids
        self.model_name = model_name
        self.model = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "radixserve"}

    async def openai_embeddings(self, request: Request) -> Response:
        """OpenAI embeddings: input str | [str] | [int] | [[int]] -> list object."""
        service = self.service
        call = service.begin("openai_embeddings")
        service.require("embedding", request.scope["path"])
        body = await parse_body(request, OpenAIEmbeddingRequest, max_items=service.limits.max_client_batch_size)
        service.check_model(body.model)
        raw = as_list(body.input)
        service.check_inputs(len(raw), empty=any(len(x) == 0 for x in raw), what="input")
        dimensions = body.dimensions or None  # 0: the full size, as Infinity reads it
        service.check_dimensions(dimensions)
        truncate = service.truncate(None)
        result: Embeddings
        if isinstance(raw[0], str):
            prompt = service.resolve_prompt(None)
            result = await service.embed(request, call, raw, prompt=prompt, truncate=truncate, direction="right",
                                         dimensions=dimensions, normalize=True)
        else:
            self.check_token_ids_allowed()
            result = await service.embed_ids(request, call, raw, truncate=truncate, dimensions=dimensions,
                                             normalize=True)
        content = await render(lambda: self.render(result, encoding_format=body.encoding_format),
                               weight=result.vectors.size)
        return json_answer(content, result.usage.headers())

    def check_token_ids_allowed(self) -> None:
        if not self.allow_token_ids:
            raise ApiError(
                "validation",
                "input holds token ids, which this server would read as its own tokenizer's ids; a client that "
                "tokenizes with another tokenizer would get the vectors of other text. LangChain's OpenAIEmbeddings "
                "does so by default (tiktoken's cl100k): give it check_embedding_ctx_length=False to send the texts. "
                "Ids from this model's tokenizer (/tokenize) are served when the server runs with --allow-token-ids")

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


def build_router(service: Service, *, model_name: str, allow_token_ids: bool = False,
                 also_at: tuple[str, ...] = ()) -> APIRouter:
    """``also_at``: more paths of the embeddings route (Infinity's --url-prefix P: P/embeddings)."""
    openai = OpenAIRoutes(service, model_name=model_name, allow_token_ids=allow_token_ids)
    router = APIRouter()
    body = openapi_body(OpenAIEmbeddingRequest)
    if not allow_token_ids:  # token ids are a 422 without --allow-token-ids: documented as texts only
        shapes = body["requestBody"]["content"]["application/json"]["schema"]["properties"]["input"]["oneOf"]
        shapes[:] = [s for s in shapes if s.get("items", {}).get("type") in (None, "string")]
    router.add_api_route(
        "/v1/embeddings", openai.openai_embeddings, methods=["POST"], response_model=OpenAIEmbeddingResponse,
        tags=["OpenAI"], openapi_extra=body,
    )
    router.add_api_route(
        "/embeddings", openai.openai_embeddings, methods=["POST"], response_model=OpenAIEmbeddingResponse,
        tags=["OpenAI"], include_in_schema=False,
    )
    for path in also_at:
        router.add_api_route(path, openai.openai_embeddings, methods=["POST"], response_model=OpenAIEmbeddingResponse,
                             tags=["OpenAI"], include_in_schema=False)
    router.add_api_route("/v1/models", openai.list_models, methods=["GET"], response_model=OpenAIModelList,
                         tags=["OpenAI"])
    router.add_api_route("/v1/models/{model_id:path}", openai.get_model, methods=["GET"], response_model=OpenAIModel,
                         tags=["OpenAI"])
    return router

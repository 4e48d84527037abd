"""Cohere's embed answer, shared by the Cohere routes (POST /v1/embed, /v2/embed) and TEI's POST /
(which takes Cohere's body too: litellm's ``cohere/`` provider posts it to the base URL).

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

import orjson
from fastapi import Request, Response

from server.http.errors import ApiError
from server.schemas.cohere import CohereEmbedRequest
from server.service.core import Call, Service
from server.service.encoding import base64_rows, dumps, float_array, json_answer, render
from server.service.results import Embeddings

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


def cohere_meta(version: str, **billed) -> dict:
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


async def answer_cohere_embed(service: Service, request: Request, body: CohereEmbedRequest, call: Call, *,
                              version: str) -> Response:
    """Cohere's embed answer to a parsed body (POST /v1/embed, /v2/embed, and POST / given Cohere's body)."""
    service.check_model(body.model)
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
    meta = cohere_meta(version, input_tokens=result.usage.tokens)

    def build() -> bytes:
        return dumps({"id": str(uuid.uuid4()), "texts": texts, "meta": meta, **by_type(result, types)})

    return json_answer(await render(build, weight=result.vectors.size), result.usage.headers())

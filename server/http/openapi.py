"""The OpenAPI schema made to describe the server, applied centrally to every route.

``install_openapi(app, ...)`` wraps FastAPI's generator once (routes added later by any module
get the same treatment): each operation documents every error status it can answer with the
body of its dialect (TEI's ``{error, error_type}``, or OpenAI's ``{error: {message, type, param,
code}}`` under /v1), the GET routes that answer an empty body (``/``, ``/health``, ``/ping``)
document no content, ``/metrics`` documents Prometheus text, and request bodies refuse what the
server refuses before running the model: empty inputs and queries (``minLength``/``minItems``),
more inputs than ``--max-client-batch-size`` (``maxItems``), token ids outside the vocabulary and
``dimensions`` above the hidden size, a ``truncation_direction`` but Right or Left, a
``prompt_name`` the model does not define, more sentences than the maximum less /similarity's
source sentence, /score's text_1 neither one nor as many as text_2, and unknown fields that are
not scalars (the server ignores them, but counts their arrays and objects against the body's
container bound). Shapes the models fix (Cohere's ``texts`` required, /predict's pairs) are
set on the pydantic models (server/schemas/). ``HeadAsGet`` answers HEAD on every GET route (the GET
answer without its body); 405s carry ``Allow`` (server/http/errors.py).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from server.http.errors import KINDS, is_openai_path

EMPTY_BODY_GETS = frozenset({"/", "/health", "/ping"})
TEXT_GETS = frozenset({"/metrics"})
# statuses any POST route may answer (the front door's and the service's), and any GET route
POST_STATUSES = (400, 401, 404, 408, 413, 415, 422, 429, 431, 500, 503)
GET_STATUSES = (404, 431, 500, 503)
# body fields that carry the inputs: never empty (a 400); lists at most --max-client-batch-size
INPUT_FIELDS = frozenset({"inputs", "input", "texts", "documents", "sentences", "source_sentence", "query",
                          "text", "ids"})
RERANK_LISTS = frozenset({"texts", "documents"})  # in a rerank body an empty document is scored
# what an unknown field may hold: the server ignores it, but counts its arrays and objects against
# the body's container bound (server/http/bodies.py), so the schema admits scalars only
SCALAR_EXTRA = {"type": ["string", "number", "boolean", "null"]}
DIRECTION_PATTERN = "^([Rr][Ii][Gg][Hh][Tt]|[Ll][Ee][Ff][Tt])$"  # Right or Left, any case

TEI_ERROR = {
    "type": "object", "required": ["error", "error_type"],
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
}
OPENAI_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": {},
                       "code": {"type": "string"}},
    }},
}


def _describe(status: int) -> str:
    kinds = sorted({tei for s, tei, _, _ in KINDS.values() if s == status})
    return " or ".join(kinds) or "error"


def _bound_inputs(node: Any, *, max_items: int, vocab_size: int, hidden_size: int, rerank: bool,
                  prompt_names: tuple[str, ...] = (), field: str | None = None, min_truncate: int = 1) -> None:
    """Add the server's input constraints to a request-body schema, in place."""
    if isinstance(node, list):
        for item in node:
            _bound_inputs(item, max_items=max_items, vocab_size=vocab_size, hidden_size=hidden_size,
                          rerank=rerank, prompt_names=prompt_names, field=field, min_truncate=min_truncate)
        return
    if not isinstance(node, dict):
        return
    if field in INPUT_FIELDS:
        kind = node.get("type")
        if kind == "string" and not (rerank and field in RERANK_LISTS):
            node.setdefault("minLength", 1)
        elif kind == "array":
            node.setdefault("minItems", 1)
            # /similarity embeds the source sentence too: it and the sentences share the maximum
            node.setdefault("maxItems", max_items - 1 if field == "sentences" else max_items)
            items = node.get("items")
            if isinstance(items, dict) and items.get("type") == "integer":  # token ids
                items.setdefault("minimum", 0)
                items.setdefault("maximum", vocab_size - 1)
            elif isinstance(items, dict) and items.get("type") == "array":  # lists of token ids
                items.setdefault("minItems", 1)
    if node.get("type") == "object" and "properties" in node:
        node.setdefault("additionalProperties", SCALAR_EXTRA)
    if field in ("dimensions", "output_dimension") and node.get("type") == "integer":
        node.setdefault("maximum", hidden_size)
    if field == "truncation_direction" and node.get("type") == "string":
        node.setdefault("pattern", DIRECTION_PATTERN)
    if field == "prompt_name" and node.get("type") == "string":
        node.setdefault("enum", sorted(prompt_names))
    if field == "truncate_prompt_tokens" and node.get("type") == "integer" and "enum" not in node:
        node["minimum"] = min_truncate  # n keeps the special tokens and at least one of the text's
    for key, value in node.items():
        if key == "properties" and isinstance(value, dict):
            for name, sub in value.items():
                _bound_inputs(sub, max_items=max_items, vocab_size=vocab_size, hidden_size=hidden_size,
                              rerank=rerank, prompt_names=prompt_names, field=name, min_truncate=min_truncate)
        elif key in ("anyOf", "oneOf", "allOf", "items", "prefixItems"):
            _bound_inputs(value, max_items=max_items, vocab_size=vocab_size, hidden_size=hidden_size,
                          rerank=rerank, prompt_names=prompt_names, field=field, min_truncate=min_truncate)


def paired(max_items: int) -> list[dict]:
    """/score's rule as a schema: one text_1 (a string or a one-item list) for every text_2, or as
    many text_1 as text_2 (one branch per list length)."""
    one = {"properties": {"text_1": {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": 1}]},
                          "text_2": {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": max_items}]}}}
    return [one] + [{"properties": {side: {"type": "array", "minItems": n, "maxItems": n}
                                    for side in ("text_1", "text_2")}} for n in range(2, max_items + 1)]


def refine(spec: dict, *, max_items: int, vocab_size: int, hidden_size: int, prompt_names: tuple[str, ...] = (),
           min_truncate: int = 1) -> dict:
    """``spec`` (FastAPI's) made truthful, in place; see the module docstring."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorTEI"], schemas["ErrorOpenAI"] = TEI_ERROR, OPENAI_ERROR
    for path, ops in spec.get("paths", {}).items():
        ref = {"$ref": "#/components/schemas/" + ("ErrorOpenAI" if is_openai_path(path) else "ErrorTEI")}
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's HTTPValidationError: ours has the dialect's body
            for status in POST_STATUSES if method == "post" else GET_STATUSES:
                responses[str(status)] = {"description": _describe(status),
                                          "content": {"application/json": {"schema": ref}}}
            if method == "get" and path in EMPTY_BODY_GETS:
                responses["200"] = {"description": "an empty body"}
            elif method == "get" and path in TEXT_GETS:
                responses["200"] = {"description": "Prometheus text format",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body is not None and {"text_1", "text_2"} <= set(body.get("properties", {})):
                body["anyOf"] = paired(max_items)
            if body is not None:
                _bound_inputs(body, max_items=max_items, vocab_size=vocab_size, hidden_size=hidden_size,
                              rerank="rerank" in path, prompt_names=prompt_names, min_truncate=min_truncate)
    return spec


def install_openapi(app: FastAPI, *, max_items: int, vocab_size: int, hidden_size: int,
                    prompt_names: tuple[str, ...] = (), min_truncate: int = 1) -> None:
    """Serve ``refine``'s schema from /openapi.json (built once, on first use)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None or not app.openapi_schema.get("x-refined"):
            spec = refine(generate(), max_items=max_items, vocab_size=vocab_size, hidden_size=hidden_size,
                          prompt_names=prompt_names, min_truncate=min_truncate)
            spec["x-refined"] = True
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class HeadAsGet:
    """ASGI middleware: HEAD is served as GET without the body (headers, Content-Length included)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headless(message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headless)

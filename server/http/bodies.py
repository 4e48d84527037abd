"""Request bodies parsed off the event loop, with cheap pre-checks before any per-item object.

``parse_body(request, Model, max_items=N)`` reads the raw body (FrontDoor has already bounded its
size and read time) and returns a validated ``Model``. The work is ordered by cost, so a hostile
body is refused before it can allocate much:
1. bytes: UTF-8 (a UTF-16/32 body is named as such), then the number of JSON arrays and objects
   outside strings, which bounds how many Python containers parsing could build (at most N
   inputs plus a few wrappers), with byte scans that never hold the GIL for long;
2. JSON parse (pydantic-core's jiter) into plain Python values;
3. the input count (``Model.count_inputs``) against N, before any per-item validation;
4. pydantic validation, whose error list is then bounded by N.
A route whose body may take one of several shapes (POST /: /embed's or /similarity's) passes
``pick(data) -> Model``, which chooses the model from the parsed JSON before steps 3-4.
Bodies larger than ``INLINE_BYTES`` run steps 1-4 in a worker thread. NOTE: the parse holds the
GIL, so the thread alone would not keep the loop responsive; the container bound is what keeps
each step short (tens of ms for a 2 MB body).
"""
from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from server.http import cache_salt
from server.http.errors import ApiError, describe_errors
from server.http.front_door import BODY_STATE

M = TypeVar("M", bound=BaseModel)

INLINE_BYTES = 16 * 1024  # smaller bodies are parsed on the loop (a thread hop costs more)
WRAPPERS = 8  # containers a body may hold besides one per input (the object, the list, ...)


def too_many(n: int, limit: int, what: str) -> ApiError:
    return ApiError("validation", f"{n} {what} in one request, more than the maximum of {limit}")


def check_encoding(raw: bytes) -> None:
    """422 unless ``raw`` is UTF-8 text that JSON allows (RFC 8259: no raw NUL anywhere)."""
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in raw:
        raise ApiError("validation", "the request body looks like UTF-16 or UTF-32; send UTF-8 JSON")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            "validation", f"the request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        ) from None


def count_containers(raw: bytes, *, limit: int) -> int:
    """JSON arrays + objects outside string literals, exact up to ``limit`` (it stops past it).

    The cheap upper bound (every bracket) settles nearly every body. Otherwise string literals
    are skipped with one ``find`` per quote. NOTE: a Python loop of short C calls on purpose: a
    single regex over a 2 MB body holds the GIL (and so the event loop) for hundreds of ms.
    """
    bound = raw.count(b"[") + raw.count(b"{")
    if bound <= limit:
        return bound
    count, pos, n = 0, 0, len(raw)
    while True:
        quote = raw.find(b'"', pos)
        end = n if quote < 0 else quote
        count += raw.count(b"[", pos, end) + raw.count(b"{", pos, end)
        if count > limit or quote < 0:
            return count
        pos = quote + 1
        while True:  # to the quote that closes this string literal
            close = raw.find(b'"', pos)
            if close < 0:
                return count  # unterminated: the JSON parser refuses it
            run = raw[pos:close]
            pos = close + 1
            if (len(run) - len(run.rstrip(b"\\"))) % 2 == 0:  # an odd run of backslashes escapes it
                break


def parse_bytes(raw: bytes, model: type[M], *, max_items: int, pick: Callable[[dict], type[M]] | None = None) -> M:
    """Steps 1-4 of the module docstring; ApiError (422) on any failure. ``pick``: see there."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte-order mark (some Windows clients send one)
    check_encoding(raw)
    what = getattr(model, "inputs_name", "inputs")
    containers = count_containers(raw, limit=max_items + WRAPPERS)
    if containers > max_items + WRAPPERS:
        raise ApiError(
            "validation",
            f"the request body holds more than {max_items + WRAPPERS} JSON arrays/objects; a request may "
            f"carry at most {max_items} {what}",
        )
    try:
        data = from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise ApiError("validation", f"malformed JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError("validation", f"the request body must be a JSON object, not {type(data).__name__}")
    if pick is not None:
        model = pick(data)
        what = getattr(model, "inputs_name", "inputs")
    count_inputs = getattr(model, "count_inputs", None)  # the input-carrying bodies define it
    n = count_inputs(data) if count_inputs is not None else 0
    if n > max_items:
        raise too_many(n, max_items, what)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError("validation", describe_errors(exc.errors(include_url=False), prefix="body")) from None


async def parse_body(
    request: Request, model: type[M], *, max_items: int, pick: Callable[[dict], type[M]] | None = None
) -> M:
    """The validated body of ``request`` (off the loop when large); its ``cache_salt``, when the
    model has the field, is remembered for the request (server/http/cache_salt.py). The body is the
    one the front door read whole (no second pass through the ASGI receive), or read here."""
    raw = request.scope.get("state", {}).get(BODY_STATE)
    if raw is None:  # an app without the front door (a bare test app)
        raw = await request.body()
    if len(raw) <= INLINE_BYTES:
        body = parse_bytes(raw, model, max_items=max_items, pick=pick)
    else:
        body = await asyncio.to_thread(parse_bytes, raw, model, max_items=max_items, pick=pick)
    cache_salt.remember(request, getattr(body, "cache_salt", None))
    return body


def openapi_body(*models: type[BaseModel]) -> dict:
    """``openapi_extra`` that documents ``models`` as the JSON request body (schema inlined; with
    several models, a oneOf of their schemas)."""
    schemas = [_inlined(m) for m in models]
    schema = schemas[0] if len(schemas) == 1 else {"oneOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _inlined(model: type[BaseModel]) -> dict:
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.split("/")[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return inline(schema)

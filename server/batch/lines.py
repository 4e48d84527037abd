"""The batch file format: reading request lines and shaping answer lines (OpenAI's batch format).

Input, one JSON object per line: ``{"custom_id": str, "method": "POST", "url": "/v1/embeddings",
"body": {...}}``; blank lines are skipped. Output, one line per request line, in OpenAI's batch
output shape (as vLLM's ``run-batch`` writes it):
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. ``error`` is
null exactly when the line succeeded (status 200); a route's failure keeps the route's own error
body in ``response.body`` and repeats its message in ``error``; a line that is not a request at
all (bad JSON, no custom_id, a repeated custom_id, over the size limit) answers status 400 with
``response.body`` null and ``error.line``, its 1-based line number in the input.

Invariants: reading is bounded per line (``max_bytes``: a longer line is skipped to its end
without being held, in blocks of at most ``SKIP_BYTES``); a bad line never stops the reader; a
read that fails (an I/O error) stops the job with one line (``Unrunnable``), never a traceback.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import IO, Any, Iterator

import orjson

from server.batch.output import Unrunnable

SKIP_BYTES = 1 << 20  # block read while skipping an over-long line (and while counting lines)


@dataclass(frozen=True)
class Request:
    """One request line: where it was, who it is, and what to send."""

    line: int  # 1-based line number in the input
    custom_id: str
    url: str  # the route's path, e.g. /v1/embeddings
    body: bytes  # the JSON body, re-encoded
    data: dict  # the parsed body (for the grouping key)


@dataclass(frozen=True)
class Invalid:
    """A line that is not a request: answered with an error line, never run."""

    line: int
    custom_id: str | None
    message: str


Line = Request | Invalid


def read_lines(stream: IO[bytes], *, max_bytes: int, name: str = "the input") -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, stripped bytes) of each non-blank line; None for a line over ``max_bytes``."""
    number = 0
    try:
        while True:
            raw = stream.readline(max_bytes + 1)
            if not raw:
                return
            number += 1
            if len(raw) > max_bytes and not raw.endswith(b"\n"):
                while True:  # skip the rest of the over-long line without keeping it
                    rest = stream.readline(SKIP_BYTES)
                    if not rest or rest.endswith(b"\n"):
                        break
                yield number, None
                continue
            text = raw.strip()
            if text:
                yield number, text
    except OSError as exc:
        raise Unrunnable(f"{name}: reading line {number + 1} failed: {exc.strerror or exc}") from None


def count_lines(path: str) -> int:
    """Non-blank lines of a file, read in blocks of ``SKIP_BYTES`` (however long a line is)."""
    n = 0
    blank = True  # the line read so far is only whitespace
    try:
        with open(path, "rb") as f:
            while block := f.read(SKIP_BYTES):
                parts = block.split(b"\n")
                for part in parts[:-1]:  # each ends a line
                    if not (blank and not part.strip()):
                        n += 1
                    blank = True
                if parts[-1].strip():
                    blank = False
    except OSError as exc:
        raise Unrunnable(f"{path}: cannot read the input: {exc.strerror or exc}") from None
    return n + (not blank)


def parse_line(number: int, raw: bytes | None, *, max_bytes: int) -> Line:
    """A request, or why the line is not one."""
    if raw is None:
        return Invalid(number, None, f"the line is longer than {max_bytes} bytes (--payload-limit)")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Invalid(number, None, f"the line is not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return Invalid(number, None, f"the line must be a JSON object, not {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Invalid(number, None, "custom_id must be a non-empty string")
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST":
        return Invalid(number, custom_id, f"method must be POST, not {method!r}")
    if not isinstance(url, str) or not url.startswith("/"):
        return Invalid(number, custom_id, "url must be a path such as /v1/embeddings")
    if not isinstance(body, dict):
        return Invalid(number, custom_id, "body must be a JSON object")
    path = url.split("?", 1)[0]
    return Request(number, custom_id, path, orjson.dumps(body), body)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def answer_line(request: Request, status: int, request_id: str, body: bytes) -> bytes:
    """The output line of a request the app answered (``body``: its JSON answer bytes)."""
    ok = status == 200
    error: dict | None = None
    try:
        parsed: Any = orjson.Fragment(body) if ok else orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = body.decode("utf-8", "replace")
    if not ok:
        error = {"code": error_code(parsed, status), "message": error_message(parsed)}
    return orjson.dumps({
        "id": new_id("batch_req"), "custom_id": request.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": parsed},
        "error": error,
    }) + b"\n"


def invalid_line(bad: Invalid, *, numbered: bool = True) -> bytes:
    """The output line of a line that is not a request (``numbered``: False where the reader does
    not know the line's place in the whole input, e.g. one block of a Ray dataset: ``line`` is null)."""
    return orjson.dumps({
        "id": new_id("batch_req"), "custom_id": bad.custom_id,
        "response": {"status_code": 400, "request_id": new_id("batch"), "body": None},
        "error": {"code": "invalid_request_line", "message": bad.message,
                  "line": bad.line if numbered else None},
    }) + b"\n"


def error_message(body: Any) -> str:
    """The message of an error body in either dialect (OpenAI's object or TEI's string)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", ""))
        if err is not None:
            return str(err)
    return str(body)


def error_code(body: Any, status: int) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("code"):
            return str(err["code"])
        if body.get("error_type"):
            return str(body["error_type"])
    return f"http_{status}"

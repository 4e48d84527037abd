"""Request ids: one per HTTP request, echoed in ``x-request-id`` and named in logs and 500 bodies.

A client-sent ``x-request-id`` is reused when it is sane (1 to 64 characters of
``[A-Za-z0-9._-]``, so it is safe to log and to echo); otherwise the server makes 16 hex
characters. The id lives in the ASGI scope's ``state`` (``request.state.request_id``), which
every layer of one request shares, including Starlette's outermost error handler.
"""
from __future__ import annotations

import re
import secrets

HEADER = "x-request-id"
_SANE = re.compile(rb"[A-Za-z0-9._-]{1,64}")


def choose(sent: bytes | None) -> str:
    """The client's id when it is sane, else a fresh one."""
    if sent is not None and _SANE.fullmatch(sent):
        return sent.decode("ascii")
    return secrets.token_hex(8)


def assign(scope) -> str:
    """Pick the id of the request in ``scope`` and store it in the scope's state."""
    sent = None
    for key, value in scope.get("headers", ()):
        if key.lower() == b"x-request-id":
            sent = value
            break
    rid = choose(sent)
    scope.setdefault("state", {})["request_id"] = rid
    return rid


def request_id(request) -> str:
    """The id of a Starlette request ("-" outside a FrontDoor-wrapped app, e.g. a bare test app)."""
    return request.scope.get("state", {}).get("request_id", "-")

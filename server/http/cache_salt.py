"""A request's prefix-cache namespace: its body's ``cache_salt``, kept in the ASGI scope's state.

``server/http/bodies.py`` ``parse_body`` remembers the salt of every body that has the field; the
service asks ``namespace(request)`` for the key the scheduler and the cache carry.
Invariant: two requests share a namespace iff both sent no salt or both sent the same salt (the
key is a SHA-256 of the salt, so distinct salts never meet, and no salt is the shared b"").
"""
from __future__ import annotations

import hashlib

_STATE = "cache_salt"


def remember(request, salt: str | None) -> None:
    """Record the body's salt (None: none sent) for the rest of this request."""
    request.scope.setdefault("state", {})[_STATE] = salt


def namespace(request) -> bytes:
    """b"" for the shared namespace, else a 32-byte digest of the request's salt."""
    salt = request.scope.get("state", {}).get(_STATE)
    if salt is None:
        return b""
    return hashlib.sha256(b"radixserve cache salt\0" + salt.encode("utf-8")).digest()

"""Each HTTP request's access line, written once its answer has gone to the socket.

uvicorn writes its access line (logger ``uvicorn.access``: ``127.0.0.1:5555 - "GET /health
HTTP/1.1" 200``) when the response starts, before the status line and headers are handed to the
transport, so every answer waits for a log record to be built, formatted and written: 0.1 ms of
a 0.5 ms ``/health`` on a 2-core Xeon (docs/performance/latency.md). ``AccessLog`` writes the same
line, on the same logger with uvicorn's message and arguments, after the last body message was
handed on, and the HTTP protocols (server/http/connections.py) switch uvicorn's own line off per
connection (uvicorn's ``access_log=False`` would instead take the logger's handlers away for the
whole process). Which requests get a line follows uvicorn: every answered one, a 500 for an app
that raised or returned without starting an answer (uvicorn sends that 500), and none for a
client seen to leave before anything was sent (uvicorn drops what is sent after that).
"""
from __future__ import annotations

import logging

from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

log = logging.getLogger("uvicorn.access")
LINE = '%s - "%s %s HTTP/%s" %d'  # uvicorn's access message


class AccessLog:
    """ASGI middleware (the outermost of the API's app): the access line after the answer."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        status = 0  # the answer's, once started (0: none, or one sent after the client left)
        logged = left = False

        async def receive_seen():
            nonlocal left
            message = await receive()
            left = left or message["type"] == "http.disconnect"
            return message

        async def send_then_log(message) -> None:
            nonlocal status, logged
            kind = message["type"]
            if kind == "http.response.start" and not left:
                status = message["status"]
            await send(message)
            if kind == "http.response.body" and not message.get("more_body", False) and status and not logged:
                logged = True
                _line(scope, status)

        try:
            await self.app(scope, receive_seen, send_then_log)
        finally:
            if not logged and (status or not left):  # started; or no answer, which uvicorn makes a 500
                _line(scope, status or 500)


def _line(scope, status: int) -> None:
    log.info(LINE, get_client_addr(scope), scope["method"], get_path_with_query_string(scope),
             scope["http_version"], status)

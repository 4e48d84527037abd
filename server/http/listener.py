"""The HTTP listener: uvicorn on our protocol and loop, our signal handling and our sockets.

- The HTTP stack (``--http-stack``): ``httptools`` (the C parser, on uvloop) or ``h11`` (pure
  Python, on asyncio's loop); ``auto`` takes httptools when it and uvloop are installed. Either
  way the protocol is ours (server/http/connections.py): request-head timeout, Nagle off, the
  connection cap, identical on both stacks.
- ``DrainingServer``: the first SIGTERM/SIGINT starts the Lifecycle drain instead of uvicorn's own
  shutdown, a second one forces the exit, and the signal is not re-raised afterwards (the process
  exits with the Lifecycle's status). It also starts and stops its side servers (the metrics
  listener, server/http/metrics_listener.py) on the same event loop, and logs accept() failures
  once per interval.
- ``bind_sockets``: TCP on --hostname/--port, plus --uds-path when given.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import threading
from typing import Sequence

import uvicorn

from server.http.connections import (HEAD_TOTAL_LIMIT, Connections, HeadTimeoutH11, RateLimitedLog,
                                     connection_limit, httptools_protocol, paced)
from server.http.lifecycle import Lifecycle

log = logging.getLogger("radixserve.server")


STACKS = ("auto", "httptools", "h11")


def resolve_stack(stack: str) -> str:
    """``auto``: httptools (on uvloop) when both are installed, else h11 on asyncio's loop."""
    if stack not in STACKS:
        raise ValueError(f"unknown HTTP stack {stack!r}; one of {', '.join(STACKS)}")
    if stack != "auto":
        return stack
    try:
        import httptools  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def protocol_class(header_timeout_s: float, *, stack: str = "auto", max_connections: int | None = None) -> type:
    """The HTTP protocol of ``stack`` with our head timeout, and a connection cap of its own."""
    base = HeadTimeoutH11 if resolve_stack(stack) == "h11" else httptools_protocol()
    book = Connections(connection_limit(max_connections))
    return type(base.__name__, (base,), {"header_timeout_s": header_timeout_s, "connections_book": book})


def uvicorn_config(app, *, stack: str, header_timeout_s: float, max_connections: int | None = None,
                   **kw) -> uvicorn.Config:
    """uvicorn.Config on our protocol and the stack's event loop (uvloop with httptools, asyncio
    with h11); ``kw``: uvicorn's other settings. uvicorn's access line is off on every connection of
    our protocol; the API's app writes its own after the answer (server/http/access_log.py).
    (uvicorn's ``access_log=False`` is not for here: it takes the ``uvicorn.access`` logger's
    handlers away for the whole process, that line included.)"""
    http = protocol_class(header_timeout_s, stack=stack, max_connections=max_connections)
    loop = "uvloop" if resolve_stack(stack) == "httptools" else "asyncio"
    # NOTE: h11's own cap (16 KiB, a 400) sits above ours, so every over-long head gets our 431.
    kw.setdefault("h11_max_incomplete_event_size", HEAD_TOTAL_LIMIT + 1024)
    return uvicorn.Config(app, http=http, loop=loop, **kw)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log accept() failures (EMFILE, ENFILE, ENOBUFS) once per interval, not a traceback each."""
    default = loop.get_exception_handler()
    limited = RateLimitedLog()

    def handler(loop, context) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS and "accept" in context.get("message", ""):
            limited(logging.ERROR, "accepting connections failed: %s", exc.strerror)
            return
        if default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


_ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose signals drive ``lifecycle`` (drain, then stop)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, *,
                 side: Sequence[tuple[uvicorn.Server, list[socket.socket]]] = ()) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.on_stop = self._stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self.side = list(side)  # (server, its sockets): started after this one, stopped with it

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        quiet_accept_errors(self._loop)
        await super().startup(sockets=sockets)
        for server, socks in self.side:
            if not server.config.loaded:
                server.config.load()
            server.lifespan = server.config.lifespan_class(server.config)
            await server.startup(sockets=socks)

    async def shutdown(self, sockets=None) -> None:
        for server, _ in self.side:
            server.force_exit = True  # its requests are short: no grace to wait for
            await server.shutdown()
        await super().shutdown(sockets=sockets)

    def _stop(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self.lifecycle.draining or self._loop is None or not self.started:
            if self.lifecycle.draining:
                log.warning("second %s: exiting now", name)
                self.force_exit = True
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(lambda: self.lifecycle.begin(f"received {name}"))

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def bind_sockets(*, hostname: str, port: int, uds_path: str | None) -> list[socket.socket]:
    """Listening sockets: TCP (IPv6 when the address has a colon), and the unix socket if asked;
    each accepts a few connections per loop iteration (``PacedListener``)."""
    family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
    tcp = socket.create_server((hostname, port), family=family, backlog=2048)
    sockets = [tcp]
    if uds_path:
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.stat(uds_path).st_mode):
                tcp.close()
                raise FileExistsError(f"--uds-path {uds_path} exists and is not a socket")
            os.unlink(uds_path)  # a stale socket from a previous run
        uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        uds.bind(uds_path)
        uds.listen(2048)
        sockets.append(uds)
    return paced(sockets)


def metrics_server(registry, *, sock: socket.socket, stack: str, header_timeout_s: float,
                   max_connections: int | None = None, on_scrape=None,
                   healthy=None) -> tuple[uvicorn.Server, list[socket.socket]]:
    """The --prometheus-port listener: /metrics (and /health with ``healthy``), on the API's stack
    and protocol, with a connection cap of its own (a side server of ``DrainingServer``, on the
    same event loop)."""
    from server.http.metrics_listener import metrics_app

    app = metrics_app(registry, on_scrape=on_scrape, healthy=healthy)
    config = uvicorn_config(app, stack=stack, header_timeout_s=header_timeout_s,
                            max_connections=max_connections, log_config=None, lifespan="off")
    return uvicorn.Server(config), [sock]

"""The HTTP listener: uvicorn with a request-head timeout, our signal handling and our sockets.

- ``HeadTimeoutH11``: turns Nagle's algorithm off on every TCP connection (see ``no_delay``), and
  adds a request-head timeout: uvicorn has no header timeout (its keep-alive timer is reset by every byte,
  so a client that dribbles a header forever holds a connection and a file descriptor forever).
  This protocol closes a connection whose request head is not complete ``header_timeout_s`` after
  the connection opened or after the previous response on it finished. The timer stops when the
  head is complete (uvicorn then creates a new request cycle); keep-alive is unaffected.
- ``DrainingServer``: the first SIGTERM/SIGINT starts the Lifecycle drain instead of uvicorn's own
  shutdown, a second one forces the exit, and the signal is not re-raised afterwards (the process
  exits with the Lifecycle's status).
- ``bind_sockets``: TCP on --hostname/--port, plus --uds-path when given.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import threading

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.http.lifecycle import Lifecycle

log = logging.getLogger("radixserve.server")


class HeadTimeoutH11(H11Protocol):
    """H11Protocol that closes connections whose request head takes too long to arrive."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport) -> None:
        no_delay(transport)
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._check_head()

    def on_response_complete(self) -> None:
        self._arm()  # NOTE: before super(): it may start a pipelined request at once
        super().on_response_complete()
        self._check_head()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._armed_cycle = self.cycle  # a new cycle object = a complete new request head
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        timer = getattr(self, "_head_timer", None)  # None too before connection_made
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _check_head(self) -> None:
        if self._head_timer is not None and self.cycle is not self._armed_cycle:
            self._disarm()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is not self._armed_cycle or self.transport.is_closing():
            return
        log.info("closing a connection from %s: no complete request head within %.1f s",
                 self.client, self.header_timeout_s)
        self.transport.close()


def no_delay(transport) -> None:
    """Set TCP_NODELAY on a TCP connection's socket.

    uvicorn writes a response's head and its body in two writes. asyncio turns Nagle off only on
    sockets whose ``proto`` is IPPROTO_TCP; ``socket.create_server`` (``bind_sockets``) makes them
    with proto 0, and so are the connections accepted from it. With Nagle on, the body of every
    response after the first on a keep-alive connection waits for the client's delayed ACK of the
    head: about 40 ms per request on Linux, more than a small forward takes.
    """
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def protocol_class(header_timeout_s: float) -> type[HeadTimeoutH11]:
    return type("HeadTimeoutH11", (HeadTimeoutH11,), {"header_timeout_s": header_timeout_s})


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose signals drive ``lifecycle`` (drain, then stop)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.on_stop = self._stop
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

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
    """Listening sockets: TCP (IPv6 when the address has a colon), and the unix socket if asked."""
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
    return sockets


def start_prometheus(port: int, *, hostname: str, registry) -> None:
    """TEI's --prometheus-port: the same registry on its own listener (a daemon thread)."""
    from prometheus_client import start_http_server

    start_http_server(port, addr=hostname, registry=registry)
    log.info("metrics also served on %s:%d", hostname, port)

"""Connection handling under both HTTP stacks: a request-head timeout, Nagle off, a connection cap.

``HeadTimeout`` is mixed into uvicorn's two HTTP/1.1 protocols (``HeadTimeoutH11`` on the
pure-Python h11 parser, ``HeadTimeoutHttptools`` on the C httptools parser). Both protocols make
a new request-cycle object exactly when a request head is complete, so one mixin serves both:
- Nagle's algorithm is turned off on every TCP connection (``no_delay``);
- request-head timeout: uvicorn has no header timeout (its keep-alive timer is reset by every
  byte, so a client that dribbles a header forever holds a connection and a file descriptor
  forever). A connection whose request head is not complete ``header_timeout_s`` after it opened,
  or after the previous response on it finished, is closed. The timer stops when the head is
  complete; keep-alive is unaffected;
- connection cap: ``Connections`` counts the open connections of one server and keeps the idle
  ones (awaiting a request head) oldest first. A connection that opens beyond the cap closes the
  oldest idle one, so a flood of idle connections can neither exhaust the process's file
  descriptors nor keep out a health probe; with none idle, the oldest one still receiving its
  body (a slow body) is closed; when every open connection has a whole request in work, the new
  one is closed at once. Accepting never fails for want of descriptors as long as the cap leaves room
  (``connection_limit``) and connections are accepted a few at a time (``PacedListener``).

- request-head size: a head is counted while it arrives, before the parser sees its bytes (the
  parsers have no limit of their own, or h11's 400 at 16 KiB). A line over ``HEAD_LINE_LIMIT``
  or a head over ``HEAD_TOTAL_LIMIT`` (nginx's 8 KiB x 4) gets a 431 and the connection is
  closed, so parsing work per connection is bounded whatever a client sends.
- request framing: a complete head is checked (``framing_problem``) before the parser sees its
  last bytes, so both stacks refuse the same ambiguous framings (RFC 9112 sections 3.2, 5.2, 6.1,
  6.3) with a 400 and close the connection: Content-Length together with Transfer-Encoding (h11
  would read the body by Transfer-Encoding and keep the connection, the request-smuggling
  pattern), a Transfer-Encoding other than one ``chunked``, more than one Content-Length or one
  that is not a decimal number, an obs-folded header line, a line ended by a bare LF, an empty
  line before the request line, and an HTTP/1.1 request without exactly one Host. Heads
  pipelined behind a request in work reach the parser unchecked; FrontDoor
  (server/http/front_door.py) checks their headers again. The rules: server/http/framing.py.

Invariant: a connection is in ``Connections.idle`` iff its head timer is armed; its head counts
(``_head_bytes``, ``_line_bytes``) are those of the head being received while the timer is armed.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import resource
import socket
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from server.http.errors import error_body, error_bytes
from server.http.framing import framing_problem

log = logging.getLogger("radixserve.server")

HEAD_LINE_LIMIT = 8 * 1024  # bytes of one request-head line (the request line or a header)
HEAD_TOTAL_LIMIT = 32 * 1024  # bytes of a whole request head

# Descriptors kept out of the connection cap: model files, threads' pipes, the metrics listener, logs.
FD_RESERVE_MIN = 64


def connection_limit(flag: int | None, soft_fd_limit: int | None = None) -> int:
    """The cap on open connections: ``flag`` (if given) within what the fd limit leaves.

    The fd-derived bound is RLIMIT_NOFILE's soft limit less a reserve of max(64, limit/8).
    """
    if soft_fd_limit is None:
        soft_fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    bound = None
    if soft_fd_limit != resource.RLIM_INFINITY and soft_fd_limit > 0:
        bound = max(1, soft_fd_limit - max(FD_RESERVE_MIN, soft_fd_limit // 8))
    if flag is None:
        return bound if bound is not None else 1 << 20
    return flag if bound is None else min(flag, bound)


class RateLimitedLog:
    """One log line per ``interval_s`` for a repeated event, with the count since the last line."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last = -float("inf")
        self._count = 0

    def __call__(self, level: int, message: str, *args) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            log.log(level, message + " (%d time(s) in the last %.0f s at most)", *args, self._count,
                    self.interval_s)
            self._last, self._count = now, 0


def receiving_body(conn) -> bool:
    """Is ``conn``'s request still arriving (its head read, its body not yet whole, no answer)?"""
    cycle = getattr(conn, "cycle", None)
    return cycle is not None and bool(getattr(cycle, "more_body", False)) and not getattr(
        cycle, "response_started", True)


class Connections:
    """The open connections of one server (``every``, oldest first), and the idle ones."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.idle: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self.every: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self.evicted = 0
        self.warn = RateLimitedLog()

    def admit(self, conn) -> bool:
        """Count ``conn`` in; False when it must be closed (at the cap, nothing idle or slow to close).

        At the cap the oldest idle connection is closed; failing that, the oldest one still
        receiving its body (slow bodies, one byte a second, would otherwise hold every connection
        until the body timeout and keep out a probe); failing that, ``conn`` itself.
        """
        self.open += 1
        self.every[conn] = None
        if self.open <= self.limit:
            return True
        while self.idle:
            victim, _ = self.idle.popitem(last=False)
            if not victim.transport.is_closing():
                close_now(victim.transport)
                self.evicted += 1
                self.warn(logging.WARNING, "at the cap of %d open connections: closed the oldest idle one",
                          self.limit)
                return True
        for victim in self.every:
            if victim is not conn and receiving_body(victim) and not victim.transport.is_closing():
                close_now(victim.transport)
                self.evicted += 1
                self.warn(logging.WARNING, "at the cap of %d open connections: closed the oldest one still "
                          "receiving its body", self.limit)
                return True
        self.warn(logging.WARNING, "at the cap of %d open connections, all busy: refused a connection",
                  self.limit)
        return False

    def left(self, conn) -> None:
        self.open -= 1
        self.idle.pop(conn, None)
        self.every.pop(conn, None)


class PacedListener(socket.socket):
    """A listening socket that accepts at most ``ACCEPT_BURST`` connections per loop iteration.

    asyncio's accept loop takes up to a backlog's worth (2048) of connections in one go, before
    any of them reaches ``connection_made``, where the cap and the eviction of idle connections
    act: under a flood it would run out of descriptors first. Accepting in small bursts lets the
    cap keep up. (uvloop accepts in libuv and never calls ``accept`` here.)
    """

    ACCEPT_BURST = 16

    def accept(self):
        used = getattr(self, "_burst_used", 0)
        if used >= self.ACCEPT_BURST:
            raise BlockingIOError("accept burst used up for this loop iteration")  # asyncio: try next time
        if used == 0:
            asyncio.get_running_loop().call_soon(self._reset_burst)
        self._burst_used = used + 1
        return super().accept()

    def _reset_burst(self) -> None:
        self._burst_used = 0


def paced(sockets: list[socket.socket]) -> list[socket.socket]:
    """The listening ``sockets`` as ``PacedListener``s (the same descriptors; the originals detached)."""
    return [PacedListener(s.family, s.type, s.proto, fileno=s.detach()) for s in sockets]


class HeadTimeout:
    """Mixin for uvicorn's HTTP protocols: head timeout, Nagle off, the connection cap, and no
    access line of uvicorn's (server/http/access_log.py writes it after the answer)."""

    header_timeout_s: float = 10.0
    connections_book: Connections | None = None
    _head_bytes: int = 0  # bytes of the head being received
    _line_bytes: int = 0  # bytes of its current (unfinished) line
    _head_tail: bytes = b""  # its last 3 bytes: a blank line split across two reads
    _head_seen: bytearray  # its bytes so far (at most HEAD_TOTAL_LIMIT): checked when whole
    # set by the protocol class (uvicorn's attributes)
    transport: Any
    loop: Any
    cycle: Any
    client: Any

    def connection_made(self, transport) -> None:
        no_delay(transport)
        self.access_log = False  # uvicorn's line, written before the answer: AccessLog's comes after it
        self._head_timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._head_seen = bytearray()
        super().connection_made(transport)  # type: ignore[misc]
        book = self.connections_book
        if book is not None:
            self._counted = True
            if not book.admit(self):
                transport.close()
                return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None and not self._head_fits(data):
            return
        super().data_received(data)  # type: ignore[misc]
        self._check_head()

    def _head_fits(self, data: bytes) -> bool:
        """Count ``data`` (up to the head's blank line) against the head limits; False once it
        answered 431 and closed the connection."""
        tail = self._head_tail
        joined = tail + data
        ends = [i + len(m) for m in (b"\r\n\r\n", b"\n\n") if (i := joined.find(m)) >= 0]
        end = min(ends) - len(tail) if ends else len(data)
        region = data[:end]
        self._head_bytes += len(region)
        first, last = region.find(b"\n"), region.rfind(b"\n")
        if first < 0:
            self._line_bytes += len(region)
            longest = self._line_bytes
        else:
            inner = region[first + 1:last].split(b"\n") if last > first else []
            longest = max(self._line_bytes + first, *map(len, inner)) if inner else self._line_bytes + first
            self._line_bytes = len(region) - last - 1
        if longest <= HEAD_LINE_LIMIT and self._head_bytes <= HEAD_TOTAL_LIMIT:
            if not ends:
                self._head_tail = joined[-3:]
                self._head_seen += region
                return True
            head = bytes(self._head_seen + region)  # the head is complete
            self._head_seen.clear()
            self._head_bytes = self._line_bytes = 0
            self._head_tail = b""
            problem = framing_problem(head)
            if problem is None:
                return True  # the parser takes over
            self._disarm()
            body = json.dumps(error_body("validation", problem, path="")).encode()
            self._refuse(400, b"Bad Request", body)
            return False
        what = (f"a request-head line over {HEAD_LINE_LIMIT} bytes" if longest > HEAD_LINE_LIMIT
                else f"a request head over {HEAD_TOTAL_LIMIT} bytes")
        self._disarm()
        status, body = error_bytes("header_too_large", f"{what}: send shorter headers", path="")
        self._refuse(status, b"Request Header Fields Too Large", body)
        return False

    def _refuse(self, status: int, reason: bytes, body: bytes) -> None:
        """Answer a JSON error before the parser saw the request, and close the connection."""
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status, reason, len(body), body))
        self.transport.close()

    def on_response_complete(self) -> None:
        self._arm()  # NOTE: before super(): it may start a pipelined request at once
        super().on_response_complete()  # type: ignore[misc]
        self._check_head()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if getattr(self, "_counted", False) and self.connections_book is not None:
            self._counted = False
            self.connections_book.left(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        self._head_bytes = self._line_bytes = 0
        self._head_tail = b""
        self._head_seen = bytearray()
        if not self.transport.is_closing():
            self._armed_cycle = self.cycle  # a new cycle object = a complete new request head
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)
            if self.connections_book is not None:
                self.connections_book.idle[self] = None

    def _disarm(self) -> None:
        timer = getattr(self, "_head_timer", None)  # None too before connection_made
        if timer is not None:
            timer.cancel()
            self._head_timer = None
            if self.connections_book is not None:
                self.connections_book.idle.pop(self, None)

    def _check_head(self) -> None:
        if self._head_timer is not None and self.cycle is not self._armed_cycle:
            self._disarm()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.connections_book is not None:
            self.connections_book.idle.pop(self, None)
        if self.cycle is not self._armed_cycle or self.transport.is_closing():
            return
        log.info("closing a connection from %s: no complete request head within %.1f s",
                 self.client, self.header_timeout_s)
        self.transport.close()


class HeadTimeoutH11(HeadTimeout, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with ``HeadTimeout``."""


def httptools_protocol() -> type:
    """uvicorn's httptools protocol with ``HeadTimeout`` (ImportError without httptools)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return type("HeadTimeoutHttptools", (HeadTimeout, HttpToolsProtocol), {})


def close_now(transport) -> None:
    """Abort ``transport`` and free its descriptor at once.

    asyncio closes a transport's socket only on a later loop iteration, while its accept loop
    takes up to a backlog's worth of connections in one go: evicting idle connections would not
    free descriptors in time, and accept() would fail with EMFILE (then asyncio stops accepting
    for a second). Its selector transports keep the socket in ``_sock``; closing it after
    ``abort`` (which unregisters it) is safe, and the transport's own close later is a no-op.
    uvloop's transports have no such attribute; libuv copes with EMFILE itself.
    """
    transport.abort()
    sock = getattr(transport, "_sock", None)
    if isinstance(sock, socket.socket):
        sock.close()


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

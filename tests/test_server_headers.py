"""Request-head size limits on both HTTP stacks: a line over 8 KiB or a head over 32 KiB gets a
431 and the connection is closed, counted while the head arrives (a 32 MB header is refused after
its first 32 KiB); heads within the limits, in one write or byte by byte, are served, and so are
keep-alive requests after them."""
from __future__ import annotations

import json
import socket

import pytest

from server.http.connections import HEAD_LINE_LIMIT, HEAD_TOTAL_LIMIT
from tests.test_server_sockets import STACKS, Running


def _exchange(port: int, parts: list[bytes], *, stop_early: bool = False) -> bytes:
    """Send ``parts`` (stopping once the server closed, if ``stop_early``) and read to EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for part in parts:
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
                if not stop_early and out.count(b"HTTP/1.1 ") >= 2:
                    break
        except ConnectionResetError:
            pass
        return out


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


@pytest.mark.parametrize("stack", STACKS)
def test_a_long_line_is_431(stack):
    with Running(stack) as run:
        ok = _exchange(run.port, [b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * (HEAD_LINE_LIMIT - 100)
                                  + b"\r\nConnection: close\r\n\r\n"])
        assert _status(ok) == 200, ok[:200]
        reply = _exchange(run.port, [b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * (HEAD_LINE_LIMIT + 1) + b"\r\n\r\n"])
        assert _status(reply) == 431, reply[:200]
        body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert body["error_type"] == "RequestHeaderFieldsTooLarge" and str(HEAD_LINE_LIMIT) in body["error"]
        long_url = _exchange(run.port, [b"GET /" + b"u" * (HEAD_LINE_LIMIT + 1) + b" HTTP/1.1\r\nHost: x\r\n\r\n"])
        assert _status(long_url) == 431


@pytest.mark.parametrize("stack", STACKS)
def test_a_long_head_is_431_even_byte_by_byte(stack):
    line = b"X-B: " + b"b" * 4000 + b"\r\n"
    lines = HEAD_TOTAL_LIMIT // len(line) + 1
    with Running(stack) as run:
        reply = _exchange(run.port, [b"GET / HTTP/1.1\r\nHost: x\r\n" + line * lines + b"\r\n"])
        assert _status(reply) == 431 and str(HEAD_TOTAL_LIMIT).encode() in reply
        head = b"GET / HTTP/1.1\r\nHost: x\r\n" + line * lines
        reply = _exchange(run.port, [head[i:i + 997] for i in range(0, len(head), 997)], stop_early=True)
        assert _status(reply) == 431
        # within the limits, in many small writes, then a second request on the same connection
        fine = b"GET / HTTP/1.1\r\nHost: x\r\n" + line * (lines - 2) + b"\r\n"
        reply = _exchange(run.port, [fine[i:i + 7] for i in range(0, len(fine), 7)] + [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"])
        assert reply.count(b"HTTP/1.1 200") == 2, reply[:300]


@pytest.mark.parametrize("stack", STACKS)
def test_a_32_mb_header_is_cut_off_after_the_limit(stack):
    with Running(stack) as run:
        chunk = b"a" * 65536
        parts = [b"GET / HTTP/1.1\r\nHost: x\r\nX-Huge: "] + [chunk] * 512  # 32 MiB, if the server read it all
        reply = _exchange(run.port, parts, stop_early=True)
        assert _status(reply) == 431
        assert _status(_exchange(run.port, [b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"])) == 200


@pytest.mark.parametrize("stack", STACKS)
def test_a_body_in_the_same_write_is_not_counted_as_head(stack):
    with Running(stack) as run:
        body = b"x" * (HEAD_TOTAL_LIMIT * 2)  # one long "line" of body bytes right after the head
        req = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        assert _status(_exchange(run.port, [req])) == 200

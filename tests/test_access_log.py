"""The access line (server/http/access_log.py): uvicorn's line, once per request, written after the
answer's last message went to the server; and a real server writes exactly one per request, on
both HTTP stacks, with a metrics port, and from front-end processes."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket

import pytest

from server.http.access_log import AccessLog
from tests.serving import free_port, http_stacks
from tests.test_server_lifecycle import Proc

SCOPE = {"type": "http", "method": "GET", "raw_path": b"/health", "query_string": b"probe=1",
         "http_version": "1.1", "client": ("10.0.0.7", 4321)}
LINE = '10.0.0.7:4321 - "GET /health?probe=1 HTTP/1.1" %d'


class Recorder(logging.Handler):
    """The access lines, in the same event list as the messages the server was given."""

    def __init__(self, events: list) -> None:
        super().__init__(logging.INFO)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(("line", record.getMessage()))


@pytest.fixture
def events():
    got: list = []
    handler = Recorder(got)
    logger = logging.getLogger("uvicorn.access")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield got
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def drive(app, events: list, *, disconnect: bool = False, scope: dict = SCOPE):
    async def receive():
        return {"type": "http.disconnect"} if disconnect else {"type": "http.request", "body": b""}

    async def send(message):
        events.append(("sent", message["type"], message.get("status"), message.get("more_body", False)))

    return asyncio.run(AccessLog(app)(scope, receive, send))


def test_the_line_comes_after_the_last_body_message(events):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})

    drive(app, events)
    assert events == [("sent", "http.response.start", 200, False), ("sent", "http.response.body", None, True),
                      ("sent", "http.response.body", None, False), ("line", LINE % 200)]


@pytest.mark.parametrize("when", ["before the start", "without an answer"])
def test_an_app_that_answers_nothing_is_logged_as_the_500_uvicorn_sends(events, when):
    async def app(scope, receive, send):
        if when == "before the start":
            raise RuntimeError("boom")

    if when == "before the start":
        with pytest.raises(RuntimeError):
            drive(app, events)
    else:
        drive(app, events)
    assert events == [("line", LINE % 500)]


def test_an_app_that_fails_after_starting_is_logged_once_with_its_status(events):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 207, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        drive(app, events)
    assert [e for e in events if e[0] == "line"] == [("line", LINE % 207)]


@pytest.mark.parametrize("answers", [False, True])
def test_a_client_that_left_before_the_answer_gets_no_line(events, answers):
    async def app(scope, receive, send):
        assert (await receive())["type"] == "http.disconnect"
        if answers:  # uvicorn drops what is sent after the client left
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    drive(app, events, disconnect=True)
    assert [e for e in events if e[0] == "line"] == []


def test_other_scopes_pass_through_untouched(events):
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])
        await send({"type": "lifespan.startup.complete"})

    drive(app, events, scope={"type": "lifespan"})
    assert seen == ["lifespan"] and events == [("sent", "lifespan.startup.complete", None, False)]


def _ask(port: int, head: str, body: bytes = b"") -> tuple[int, int]:
    """One request on its own connection: (the client's port, the status)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        return sock.getsockname()[1], int(got.split(b" ", 2)[1])


def _requests(port: int) -> list[str]:
    """Four requests and the access lines they must leave."""
    body = b'{"input": "hello"}'
    asked = [("GET", "/health?probe=1", _ask(port, "GET /health?probe=1 HTTP/1.1\r\nHost: x\r\n")),
             ("POST", "/v1/embeddings", _ask(port, "POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                              f"application/json\r\nContent-Length: {len(body)}\r\n", body)),
             ("GET", "/nope", _ask(port, "GET /nope HTTP/1.1\r\nHost: x\r\n")),
             ("HEAD", "/health", _ask(port, "HEAD /health HTTP/1.1\r\nHost: x\r\n"))]
    assert [status for _, _, (_, status) in asked] == [200, 200, 404, 200]
    return [f'127.0.0.1:{client} - "{method} {path} HTTP/1.1" {status}' for method, path, (client, status) in asked]


def _serve_and_read(model_dir, *flags: str) -> None:
    srv = Proc(model_dir, *flags)
    try:
        expected = _requests(srv.port)
        srv.proc.send_signal(signal.SIGTERM)
        code, out = srv.wait(timeout=600)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    lines = [line.split("uvicorn.access: ", 1)[1] for line in out.splitlines() if "uvicorn.access: " in line]
    # the start-up probes' lines come first (Proc polls /health from its own connections)
    assert lines[-len(expected):] == expected, out
    assert all(line.endswith('"GET /health HTTP/1.1" 200') for line in lines[:-len(expected)]), lines
    assert code == 0, out


@pytest.mark.parametrize("stack", http_stacks())
def test_a_server_writes_one_uvicorn_line_per_request(tiny_embedding_dir, stack):
    _serve_and_read(tiny_embedding_dir, "--http-stack", stack)


@pytest.mark.parametrize("flag", ["--prometheus-port", "--api-server-count"])
def test_with_a_metrics_port_and_with_front_ends_too(tiny_embedding_dir, flag):
    # NOTE: uvicorn's own switch (access_log=False on the metrics listener) took the logger's
    # handlers away for the whole process, and the API's lines with them
    _serve_and_read(tiny_embedding_dir, flag, str(free_port()) if flag == "--prometheus-port" else "2")

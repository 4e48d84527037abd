"""The listener's connections on both HTTP stacks (h11 and httptools): small writes go out at once
(Nagle off), a slow request head is cut off, the connection cap closes idle connections first;
uvicorn on the sockets ``bind_sockets`` makes (as the CLI runs it), checked on the server's own
accepted sockets."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from server.http import connections, listener
from tests.serving import free_port, http_stacks

STACKS = http_stacks()


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _server_sockets(server: uvicorn.Server) -> list[socket.socket]:
    return [conn.transport.get_extra_info("socket") for conn in list(server.server_state.connections)]


class Running:
    """``_app`` under the CLI's listener stack on a fresh loopback port, in a thread."""

    def __init__(self, stack: str, *, header_timeout_s: float = 10.0, max_connections: int | None = None) -> None:
        self.port = free_port()
        self.sockets = listener.bind_sockets(hostname="127.0.0.1", port=self.port, uds_path=None)
        config = listener.uvicorn_config(_app, stack=stack, header_timeout_s=header_timeout_s,
                                         max_connections=max_connections, log_config=None, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": self.sockets}, daemon=True)

    def __enter__(self) -> "Running":
        self.thread.start()
        deadline = time.monotonic() + 600  # catches a hang only
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        for sock in self.sockets:
            sock.close()


@pytest.mark.parametrize("stack", STACKS)
def test_accepted_tcp_connections_have_nagle_off(stack):
    with Running(stack) as run:
        # The cause: connections accepted from these listeners are not IPPROTO_TCP sockets to asyncio,
        # so nothing else turns Nagle off on them.
        assert run.sockets[0].proto != socket.IPPROTO_TCP
        with httpx.Client(base_url=f"http://127.0.0.1:{run.port}") as client:
            for _ in range(2):  # the second request rides the same keep-alive connection
                assert client.get("/").text == "ok"
            accepted = _server_sockets(run.server)
            assert len(accepted) == 1
            assert accepted[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            assert type(list(run.server.server_state.connections)[0]).__mro__[1].__name__.lower().endswith(
                "h11" if stack == "h11" else "httptools")


def _closed_within(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except socket.timeout:
        return False
    except ConnectionResetError:
        pass
    return True


@pytest.mark.parametrize("stack", STACKS)
def test_slow_request_head_is_closed_and_keep_alive_survives(stack):
    with Running(stack, header_timeout_s=0.5) as run:
        with socket.create_connection(("127.0.0.1", run.port)) as s:
            t0 = time.monotonic()
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never the blank line
            assert _closed_within(s, 5.0) and time.monotonic() - t0 < 4.0
        with socket.create_connection(("127.0.0.1", run.port)) as s:
            s.settimeout(5)
            for _ in range(2):  # each head in time, the pause between them longer than the timeout
                for part in (b"GET / HTTP/1.1\r\n", b"Host: x\r\n\r\n"):
                    s.sendall(part)
                    time.sleep(0.2)
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
            assert _closed_within(s, 5.0)  # idle after its response: closed by the head timer


@pytest.mark.parametrize("stack", STACKS)
def test_connection_cap_closes_the_oldest_idle_connection(stack):
    with Running(stack, max_connections=3) as run:
        idle = [socket.create_connection(("127.0.0.1", run.port)) for _ in range(3)]
        try:
            time.sleep(0.3)
            with httpx.Client(base_url=f"http://127.0.0.1:{run.port}") as client:
                assert client.get("/", timeout=5).text == "ok"  # in, though 3 were open
            assert _closed_within(idle[0], 5.0)  # the oldest made room
            idle[1].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # a younger one still works
            idle[1].settimeout(5)
            assert idle[1].recv(65536).startswith(b"HTTP/1.1 200")
        finally:
            for s in idle:
                s.close()


def test_connection_limit_leaves_room_for_other_files():
    assert connections.connection_limit(None, 1024) == 1024 - 128
    assert connections.connection_limit(None, 256) == 256 - 64
    assert connections.connection_limit(100, 1024) == 100
    assert connections.connection_limit(5000, 1024) == 896
    assert listener.resolve_stack("h11") == "h11"
    with pytest.raises(ValueError):
        listener.resolve_stack("h2")


def test_no_delay_leaves_unix_sockets_alone(tmp_path):
    class Transport:
        def __init__(self, sock):
            self.sock = sock

        def get_extra_info(self, name):
            return self.sock if name == "socket" else None

    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        connections.no_delay(Transport(left))  # no TCP option on a unix socket: nothing raised
    connections.no_delay(Transport(None))

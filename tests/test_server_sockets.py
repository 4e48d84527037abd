"""The listener's connections send small writes at once: uvicorn on the sockets ``bind_sockets``
makes (as the CLI runs it), with our protocol, checked on the server's own accepted sockets."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from server.http import listener
from tests.serving import free_port


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _server_sockets(server: uvicorn.Server) -> list[socket.socket]:
    return [conn.transport.get_extra_info("socket") for conn in list(server.server_state.connections)]


def test_accepted_tcp_connections_have_nagle_off():
    port = free_port()
    sockets = listener.bind_sockets(hostname="127.0.0.1", port=port, uds_path=None)
    # The cause: connections accepted from these listeners are not IPPROTO_TCP sockets to asyncio,
    # so nothing else turns Nagle off on them.
    assert sockets[0].proto != socket.IPPROTO_TCP
    config = uvicorn.Config(_app, http=listener.protocol_class(10.0), log_config=None, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(2):  # the second request rides the same keep-alive connection
                assert client.get("/").text == "ok"
            accepted = _server_sockets(server)
            assert len(accepted) == 1
            assert accepted[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        server.should_exit = True
        thread.join(30)
        for sock in sockets:
            sock.close()


def test_no_delay_leaves_unix_sockets_alone(tmp_path):
    class Transport:
        def __init__(self, sock):
            self.sock = sock

        def get_extra_info(self, name):
            return self.sock if name == "socket" else None

    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        listener.no_delay(Transport(left))  # no TCP option on a unix socket: nothing raised
    listener.no_delay(Transport(None))

"""Probes that cannot be starved: with the API port's connection cap filled by slow bodies (each
sends its head and Content-Length, then a byte now and then), /health on the --prometheus-port
listener, which has connections of its own, answers every probe; and it follows the worker's
health as the API's /health does."""
from __future__ import annotations

import socket

import httpx
import pytest

from tests.serving import free_port, http_stacks
from tests.test_server_lifecycle import Proc


def test_health_on_the_metrics_port_survives_slow_bodies_at_the_cap(tiny_embedding_dir):
    """One stack (the default): the listener and the cap are the same code on both
    (test_at_the_cap_a_probe_closes_the_oldest_slow_body runs each)."""
    prom = free_port()
    srv = Proc(tiny_embedding_dir, "--max-connections", "16", "--prometheus-port", str(prom),
               "--body-read-timeout", "60")
    slow: list[socket.socket] = []
    try:
        for _ in range(24):  # more than the cap: the API port is full of busy (body-reading) connections
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
            slow.append(s)
        for _ in range(20):
            r = httpx.get(f"http://127.0.0.1:{prom}/health", timeout=10)
            assert r.status_code == 200 and r.content == b""
        assert httpx.head(f"http://127.0.0.1:{prom}/health", timeout=10).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{prom}/metrics", timeout=10).status_code == 200
        assert httpx.post(f"http://127.0.0.1:{prom}/health", timeout=10).headers["allow"] == "GET, HEAD"
    finally:
        for s in slow:
            s.close()
        srv.proc.terminate()
        srv.wait(60)


def test_metrics_port_health_follows_the_worker():
    import asyncio

    from prometheus_client import CollectorRegistry

    from server.http.metrics_listener import metrics_app

    state = {"ok": True}
    app = metrics_app(CollectorRegistry(), healthy=lambda: state["ok"])

    def get(path: str) -> tuple[int, bytes]:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        asyncio.run(app({"type": "http", "method": "GET", "path": path}, None, send))
        return sent[0]["status"], sent[1]["body"]

    assert get("/health") == (200, b"")
    state["ok"] = False
    assert get("/health")[0] == 503
    assert get("/info")[0] == 404
    bare = metrics_app(CollectorRegistry())
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    asyncio.run(bare({"type": "http", "method": "GET", "path": "/health"}, None, send))
    assert sent[0]["status"] == 404


async def _reading_app(scope, receive, send):
    """Reads the whole body before answering (as the API's routes do)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("stack", http_stacks())
def test_at_the_cap_a_probe_closes_the_oldest_slow_body(stack):
    """With every connection of the API port holding a slow body, a new connection (a probe)
    closes the oldest slow body instead of being refused."""
    import threading
    import time

    import uvicorn

    from server.http import listener

    port = free_port()
    sockets = listener.bind_sockets(hostname="127.0.0.1", port=port, uds_path=None)
    config = listener.uvicorn_config(_reading_app, stack=stack, header_timeout_s=10.0, max_connections=8,
                                     log_config=None, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    slow: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 600  # catches a hang only
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            slow.append(s)
        time.sleep(0.3)  # every head read: the connections are receiving their bodies
        for _ in range(5):
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10, headers={"connection": "close"})
            assert r.status_code == 200
        closed = 0
        for s in slow:
            s.settimeout(0.5)
            try:
                closed += s.recv(10) == b""
            except ConnectionResetError:
                closed += 1
            except socket.timeout:
                pass
        assert closed >= 1  # the oldest slow bodies made room
    finally:
        for s in slow:
            s.close()
        server.should_exit = True
        thread.join(30)
        for sock in sockets:
            sock.close()

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


@pytest.mark.parametrize("stack", http_stacks())
def test_health_on_the_metrics_port_survives_slow_bodies_at_the_cap(tiny_embedding_dir, stack):
    prom = free_port()
    srv = Proc(tiny_embedding_dir, "--http-stack", stack, "--max-connections", "16", "--prometheus-port", str(prom),
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

"""A zero-cost responder: the load client's own ceiling.

    python -m loadtest.responder --port 8099 --dims 1024 [--workers 2]

Answers every POST with a well-formed answer of the right item count and does no other work
(answers are rendered once per (route, count, encoding) and reused), so a run of the load client
against it measures what the client itself can send, receive and check per second on this host.
A real server's rate is only trusted when it is well below that ceiling (`measure_ceiling`,
`headroom`). Routes: /v1/embeddings (float or base64 vectors, as asked), /embed (float lists),
/rerank (scores); GET /health answers 200, anything else 404. HTTP/1.1 keep-alive, bodies by
Content-Length only (the load client sends nothing else). `--workers N` forks N processes on one
port (SO_REUSEPORT) so the responder is never the slower side.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
from dataclasses import replace

from loadtest import client
from loadtest.workloads import Request, expected_count

MAX_BODY = 64 << 20  # bytes of one request body; more closes the connection
CLEAN_HEADROOM = 2.0  # a run is clean when the client's ceiling is at least this many times its rate


def _render(route: str, count: int, encoding: str, dims: int) -> bytes:
    """The JSON answer to a request of `count` items on `route` (the values are all 0.5)."""
    if route == "/v1/embeddings":
        vec: object = (base64.b64encode(b"\x00\x00\x00\x3f" * dims).decode() if encoding == "base64"
                       else [0.5] * dims)
        data = [{"object": "embedding", "index": i, "embedding": vec} for i in range(count)]
        return json.dumps({"object": "list", "data": data, "model": "responder",
                           "usage": {"prompt_tokens": 0, "total_tokens": 0}}).encode()
    if route == "/rerank":
        return json.dumps([{"index": i, "score": 0.5} for i in range(count)]).encode()
    return json.dumps([[0.5] * dims for _ in range(count)]).encode()


class Responder:
    def __init__(self, dims: int) -> None:
        self.dims = dims
        self.cache: dict[tuple[str, int, str], bytes] = {}

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if method == "GET":
            return (200, b'"ok"') if path == "/health" else (404, b"{}")
        try:
            doc = json.loads(body)
            key = (path, expected_count(doc), str(doc.get("encoding_format", "float")))
        except (ValueError, AttributeError, TypeError):
            return 422, b'{"error": "bad body"}'
        if key not in self.cache:
            self.cache[key] = _render(key[0], key[1], key[2], self.dims)
        return 200, self.cache[key]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = (lines[0].split(" ") + ["", ""])[:2]
                length = 0
                for ln in lines[1:]:
                    name, _, value = ln.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                if not 0 <= length <= MAX_BODY:
                    break
                body = await reader.readexactly(length) if length else b""
                status, payload = self.answer(method, path, body)
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                             % (status, len(payload)) + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


async def _serve(port: int, dims: int) -> None:
    r = Responder(dims)
    server = await asyncio.start_server(r.handle, "127.0.0.1", port, reuse_port=True, limit=1 << 20)
    async with server:
        await server.serve_forever()


def serve(port: int, dims: int, workers: int = 1) -> None:
    """Serve on 127.0.0.1:port until killed; `workers` > 1 forks that many processes on the port."""
    for _ in range(workers - 1):
        if os.fork() == 0:
            break
    asyncio.run(_serve(port, dims))


def measure_ceiling(requests: list[Request], cfg: client.RunConfig, *, dims: int,
                    workers: int = 1) -> client.RunResult:
    """The load client's rate on `requests` with `cfg` (its url is ignored) against a responder
    started for the run in a process group of its own, then stopped."""
    from loadtest.compare import free_port

    port = free_port()
    argv = [sys.executable, "-m", "loadtest.responder", "--port", str(port), "--dims", str(dims),
            "--workers", str(workers)]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        client.wait_healthy(url, timeout=30, alive=lambda: proc.poll() is None)
        return client.run(requests, replace(cfg, url=url, metrics_urls=()))
    finally:
        try:
            os.killpg(proc.pid, 15)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def headroom(fastest_items_per_s: float | None, ceiling_items_per_s: float | None) -> dict:
    """The client's ceiling over the fastest measured rate, and whether that is CLEAN_HEADROOM or more."""
    if not fastest_items_per_s or not ceiling_items_per_s:
        return {"headroom": None, "clean": None}
    h = ceiling_items_per_s / fastest_items_per_s
    return {"headroom": h, "clean": h >= CLEAN_HEADROOM}


def main(argv=None) -> int:
    p = argparse.ArgumentParser("python -m loadtest.responder", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dims", type=int, default=1024, help="vector width of embedding answers")
    p.add_argument("--workers", type=int, default=1, help="processes on the port (SO_REUSEPORT)")
    a = p.parse_args(argv)
    try:
        serve(a.port, a.dims, max(1, a.workers))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

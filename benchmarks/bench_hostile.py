"""Hostile clients against a running server, with /health probed all along.

    python -m benchmarks.bench_hostile --url http://127.0.0.1:8080 [--probe-url http://127.0.0.1:9000]
        [--attacks none,bodies,headers,idle,slow] [--idle 3000] [--slow 520] [--seconds 5]
    (pairs: against a classifier; scores: against a reranker)

Each attack runs for ``--seconds`` (the bodies: until answered) while one thread GETs /health every
20 ms on the API port and, with ``--probe-url``, on the --prometheus-port listener. Per attack it
prints the attack's answers (``none``: no attack, the control) and each port's probe latency (p50/p99/max, ms) and how many probes
failed (refused, reset or timed out after 2 s):
- ``bodies``: the hostile bodies (1.9M digits to /embed with truncate, and without; ``"word " * 4000``
  to /embed_all; a 1.5M-letter word truncated from the left), one after another;
- ``pairs`` (a classifier): one /predict pair of 1.0M + 0.95M digits, then four at once;
- ``scores`` (a reranker): /score and /v1/score with 2,048 distinct short ``text_1`` (each pair
  tokenized apart: the event loop's old stall) and one 1.9M-digit query against 64 documents;
- ``headers``: a 32 MB header sent in 64 KiB writes (the server answers 431 after 32 KiB);
- ``idle``: ``--idle`` connections that open and send nothing;
- ``slow``: ``--slow`` connections that send a POST head with ``Content-Length: 1000`` and then
  one byte a second (with ``--max-connections`` below ``--slow``, they fill the API port).
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from urllib.parse import urlparse

import httpx

BODIES = [
    ("/embed", {"inputs": "1" * 1_900_000, "truncate": True}),
    ("/embed", {"inputs": "1" * 1_900_000, "truncate": False}),
    ("/embed_all", {"inputs": ["word " * 4000], "truncate": True}),
    ("/embed", {"inputs": "a" * 1_500_000, "truncate": True, "truncation_direction": "Left"}),
]


def probe_once(url: str, timeout: float = 2.0) -> bool:
    """One kubelet-style probe: a new connection, ``GET /health``, read the whole answer.

    Raw sockets, so the figure is the server's and not an HTTP client library's set-up
    (building an ``httpx`` client with its TLS context costs tens of milliseconds)."""
    host, port = _address(url)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply.startswith(b"HTTP/1.1 200")


class Prober(threading.Thread):
    """Probe ``url``/health every ``interval_s`` (:func:`probe_once`, failing past ``timeout`` s, as a
    kubelet probe does); latencies in ms, failures counted. It probes at least once, however soon
    it is stopped."""

    def __init__(self, url: str, interval_s: float = 0.02, timeout: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.url, self.interval_s, self.timeout = url, interval_s, timeout
        self.latencies: list[float] = []
        self.failed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            try:
                ok = probe_once(self.url, self.timeout)
            except OSError:
                ok = False
            if ok:
                self.latencies.append((time.perf_counter() - t0) * 1e3)
            else:
                self.failed += 1
            if self.stop.wait(max(0.0, self.interval_s - (time.perf_counter() - t0))):
                break

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        if not lat:
            return {"probes": self.failed, "failed": self.failed}
        return {"probes": len(lat) + self.failed, "failed": self.failed, "p50_ms": round(statistics.median(lat), 1),
                "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1), "max_ms": round(lat[-1], 1)}


def _address(url: str) -> tuple[str, int]:
    parts = urlparse(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def attack_bodies(url: str, seconds: float) -> list:
    out = []
    for path, body in BODIES:
        t0 = time.perf_counter()
        try:
            status: int | str = httpx.post(url + path, json=body, timeout=120).status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        out.append({"path": path, "status": status, "s": round(time.perf_counter() - t0, 2)})
    return out


PAIRS = [("/predict", {"inputs": ["1" * 1_000_000, "2" * 950_000], "truncate": True})]
SCORES = [
    ("/score", {"text_1": [f"query {i}" for i in range(2048)], "text_2": [f"document {i}" for i in range(2048)]}),
    ("/v1/score", {"text_1": [f"query {i}" for i in range(2048)], "text_2": [f"document {i}" for i in range(2048)]}),
    ("/score", {"text_1": "7" * 1_900_000, "text_2": [f"document {i}" for i in range(64)]}),
]


def _post_all(url: str, bodies: list, *, concurrent: int = 1) -> list:
    """Each body once (``concurrent``: that many copies of each at once); status and seconds."""
    out: list = []

    def one(path: str, body: dict) -> None:
        t0 = time.perf_counter()
        try:
            status: int | str = httpx.post(url + path, json=body, timeout=300).status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        out.append({"path": path, "status": status, "s": round(time.perf_counter() - t0, 2)})

    for path, body in bodies:
        threads = [threading.Thread(target=one, args=(path, body)) for _ in range(concurrent)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return out


def attack_pairs(url: str, seconds: float) -> list:
    return _post_all(url, PAIRS) + _post_all(url, PAIRS, concurrent=4)


def attack_scores(url: str, seconds: float) -> list:
    return _post_all(url, SCORES)


def attack_headers(url: str, seconds: float) -> list:
    with socket.create_connection(_address(url), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Huge: ")
        sent = 0
        try:
            for _ in range(512):  # 32 MiB
                sock.sendall(b"a" * 65536)
                sent += 65536
        except OSError:
            pass
        try:
            reply = sock.recv(200)
        except OSError:
            reply = b""
    return [{"sent_bytes_before_close": sent, "reply": reply.split(b"\r\n", 1)[0].decode("latin-1")}]


def _hold(url: str, n: int, seconds: float, head: bytes | None) -> list:
    socks, refused = [], 0
    for _ in range(n):
        try:
            s = socket.create_connection(_address(url), timeout=5)
            if head is not None:
                s.sendall(head)
            socks.append(s)
        except OSError:
            refused += 1
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(1.0)
        if head is not None:
            for s in socks:
                try:
                    s.sendall(b" ")  # one byte a second of a body that never completes
                except OSError:
                    pass
    for s in socks:
        s.close()
    return [{"opened": len(socks), "refused": refused}]


def attack_idle(url: str, seconds: float, *, count: int) -> list:
    return _hold(url, count, seconds, None)


def attack_slow(url: str, seconds: float, *, count: int) -> list:
    head = b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    return _hold(url, count, seconds, head)


def run(url: str, probe_url: str | None, attacks: list[str], *, seconds: float, idle: int, slow: int,
        probe_timeout: float = 2.0) -> dict:
    table = {"none": lambda u, s: time.sleep(s) or [], "bodies": attack_bodies, "headers": attack_headers,
             "pairs": attack_pairs, "scores": attack_scores,
             "idle": lambda u, s: attack_idle(u, s, count=idle), "slow": lambda u, s: attack_slow(u, s, count=slow)}
    report = {}
    for name in attacks:
        probers = {"api": Prober(url, timeout=probe_timeout)}
        if probe_url:
            probers["probe_port"] = Prober(probe_url, timeout=probe_timeout)
        for p in probers.values():
            p.start()
        answers = table[name](url, seconds)
        for p in probers.values():
            p.stop.set()
            p.join()
        report[name] = {"answers": answers, **{k: p.summary() for k, p in probers.items()}}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--probe-url", help="the --prometheus-port listener, probed beside the API port")
    parser.add_argument("--attacks", default="none,bodies,headers,idle,slow")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--idle", type=int, default=3000)
    parser.add_argument("--slow", type=int, default=520)
    args = parser.parse_args(argv)
    report = run(args.url.rstrip("/"), args.probe_url and args.probe_url.rstrip("/"), args.attacks.split(","),
                 seconds=args.seconds, idle=args.idle, slow=args.slow)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

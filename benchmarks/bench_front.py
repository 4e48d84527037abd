"""Front-end benchmarks: what a big answer does to everyone else, and the GIL's switch interval.

    python -m benchmarks.bench_front big-answer --url http://127.0.0.1:8080 [--inputs 2048]
    python -m benchmarks.bench_front switch-interval [--preset qwen3-0.6b --layers 2]
    python -m benchmarks.bench_front hops [--preset tiny-embedding]
    python -m benchmarks.bench_front one-input --target new=http://127.0.0.1:8080 --target old=URL
    python -m benchmarks.bench_front forward-rate --model-dir DIR [--radix-mlp-threshold 0]

``big-answer`` (HTTP only): one request with ``--inputs`` short inputs (float JSON, 2048 x the
hidden size) while /health is probed every 20 ms and one-input requests run back to back; prints
/health p50/p99/max during the big request, and the one-input requests' front-end time (client
latency less their queue and forward time from the x-* headers) alone and during it.
``switch-interval`` (in process): the forward of a small batch on the worker thread while threads
parse request bodies and tokenize (the server's busy Python), for several ``sys.setswitchinterval``
values, interleaved round by round; prints forward ms and the background work done.
``hops`` (in process): the median cost of each hop of a one-input request, before and after.
``forward-rate`` (in process, benchmarks/forward_rate.py): items/s of the embed-template batches through the runner alone,
the reference for the server's full-load rate.
``one-input``: c1 keep-alive latency of a one-input /embed (and /health) on raw sockets, servers
alternating request by request, so a client library's own milliseconds are not in the figure.
The one-request latency (c1) and full-load rates use the load tester: docs/loadtest.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import httpx
import numpy as np

from benchmarks.forward_rate import forward_rate
from loadtest import machine
from loadtest.alternate import turn_order


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _front_ms(r: httpx.Response, elapsed_s: float) -> float:
    """Client latency less the server's queue and forward time: what the front end cost."""
    server = float(r.headers.get("x-queue-time", 0)) + float(r.headers.get("x-inference-time", 0))
    return elapsed_s * 1e3 - server


def big_answer(url: str, *, inputs: int = 2048, route: str = "/embed", probe_s: float = 0.02,
               timeout: float = 600.0) -> dict:
    """Figures of one big answer against /health probes and back-to-back one-input requests."""
    texts = [f"item {i} of the big request" for i in range(inputs)]
    with httpx.Client(base_url=url, timeout=timeout) as c:
        c.post(route, json={"inputs": texts[:4]}).raise_for_status()  # warm
        alone = []
        for _ in range(20):
            t0 = time.perf_counter()
            r = c.post(route, json={"inputs": "one short input"})
            alone.append(_front_ms(r, time.perf_counter() - t0))
    result: dict = {}
    done = threading.Event()

    def big() -> None:
        with httpx.Client(base_url=url, timeout=timeout) as c:
            t0 = result["t0"] = time.perf_counter()
            r = c.post(route, json={"inputs": texts})
            result["big_s"] = time.perf_counter() - t0
            result["big_status"], result["big_bytes"] = r.status_code, len(r.content)
            result["big_server_s"] = float(r.headers.get("x-total-time", "nan")) / 1e3
        done.set()

    def small(out: list[float]) -> None:
        with httpx.Client(base_url=url, timeout=timeout) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                r = c.post(route, json={"inputs": "one short input"})
                out.append(_front_ms(r, time.perf_counter() - t0))

    during: list[float] = []
    health: list[tuple[float, float]] = []  # (sent at, ms)
    threading.Thread(target=big, daemon=True).start()
    threading.Thread(target=small, args=(during,), daemon=True).start()
    with httpx.Client(base_url=url, timeout=timeout) as c:
        while not done.is_set():
            t0 = time.perf_counter()
            c.get("/health")
            health.append((t0, (time.perf_counter() - t0) * 1e3))
            time.sleep(probe_s)
    # The answer is shaped and rendered after the server's x-total-time (taken when the outputs came).
    rendering = result["t0"] + result.pop("big_server_s")
    whole = [ms for _, ms in health]
    late = [ms for at, ms in health if at + ms / 1e3 >= rendering]
    t0 = result.pop("t0")
    return {
        **result, "big_outputs_after_s": rendering - t0,
        "health_n": len(whole), "health_p50_ms": _quantile(whole, 0.5), "health_p99_ms": _quantile(whole, 0.99),
        "health_max_ms": max(whole, default=float("nan")),
        "health_while_rendering_n": len(late), "health_while_rendering_p99_ms": _quantile(late, 0.99),
        "health_while_rendering_max_ms": max(late, default=float("nan")),
        "one_input_front_alone_p50_ms": statistics.median(alone),
        "one_input_front_during_p50_ms": statistics.median(during) if during else float("nan"),
        "one_input_front_during_max_ms": max(during, default=float("nan")), "one_input_during_n": len(during),
    }


def switch_interval(*, preset: str = "qwen3-0.6b", layers: int = 2, intervals=(0.005, 0.002, 0.001, 0.0005),
                    rounds: int = 5, per_round: int = 20, busy_threads: int = 2) -> list[dict]:
    """Forward ms of a 16-token batch on a worker thread, alone and while ``busy_threads`` parse
    request bodies (pure Python holding the GIL, as the server's parsing and prep do), per
    switch interval; variants interleave round by round."""

    import models
    import fixtures
    from server.http.bodies import parse_bytes
    from server.schemas.tei import EmbedRequest

    runner = models.load_runner(str(fixtures.cached(preset, layers=layers)), device="cpu", dtype="float32",
                                prefix_cache_size=0)
    ids = np.arange(100, 116, dtype=np.int32)
    cu = np.array([0, 16], np.int32)
    body = json.dumps({"inputs": [f"a body of text number {i} to parse" for i in range(256)]}).encode()
    busy = threading.Event()
    stop = threading.Event()
    work = [0]

    def background() -> None:
        while not stop.is_set():
            if not busy.wait(0.05):
                continue
            n = len(parse_bytes(body, EmbedRequest, max_items=2048).inputs)
            if busy.is_set():  # a parse that ends after its window counts for nobody
                work[0] += n

    def forwards(out: list[float]) -> None:
        for _ in range(per_round):
            s = time.perf_counter()
            runner.run(runner.prepare(ids, cu))
            out.append((time.perf_counter() - s) * 1e3)

    threads = [threading.Thread(target=background, daemon=True) for _ in range(busy_threads)]
    for t in threads:
        t.start()
    old = sys.getswitchinterval()
    keys = [(i, b) for i in intervals for b in (False, True)]
    times: dict = {k: [] for k in keys}
    done: dict = {k: 0 for k in keys}
    spent: dict = {k: 0.0 for k in keys}
    try:
        for _ in range(rounds):
            for interval, loaded in keys:
                sys.setswitchinterval(interval)
                (busy.set if loaded else busy.clear)()
                w0, t0 = work[0], time.perf_counter()
                worker = threading.Thread(target=forwards, args=(times[(interval, loaded)],))
                worker.start()
                worker.join()
                done[(interval, loaded)] += work[0] - w0
                spent[(interval, loaded)] += time.perf_counter() - t0
    finally:
        stop.set()
        busy.clear()
        sys.setswitchinterval(old)
    return [{"switch_interval_ms": i * 1e3, "parsing_threads": busy_threads if b else 0,
             "forward_p50_ms": round(statistics.median(times[(i, b)]), 2),
             "forward_p90_ms": round(_quantile(times[(i, b)], 0.9), 2),
             "inputs_parsed_per_s": round(done[(i, b)] / spent[(i, b)])} for i, b in keys]


def hops(*, preset: str = "tiny-embedding", layers: int | None = None, reps: int = 300) -> list[dict]:
    """Median microseconds of each hop of a one-input /embed request, in process, before and after.

    "before": tokenization through the thread pool, the batch handed to the worker thread, the
    answer through ``json.dumps(v.tolist())``; "after": what the server does now for a short
    input at an idle CPU pipeline (inline tokenization, the batch run on the prep thread, orjson).
    Variants interleave request by request; the scheduler rows exclude the runner's own time.
    """
    import asyncio
    from concurrent.futures import ThreadPoolExecutor


    import models
    import fixtures
    from models.text import prompts
    from scheduler import Scheduler
    from server.http.bodies import parse_bytes
    from server.schemas.tei import EmbedRequest
    from server.service import encoding
    from server.service.results import shape_vectors

    runner = models.load_runner(str(fixtures.cached(preset, layers=layers)), device="cpu", dtype="float32",
                                prefix_cache_size=0)
    query = "Instruct: Given a web search query, retrieve relevant passages\nQuery: what is the capital of france"
    body = json.dumps({"inputs": query}).encode()
    forward_s: list[float] = []
    real_run = runner.run

    def timed_run(p):
        t0 = time.perf_counter()
        try:
            return real_run(p)
        finally:
            forward_s.append(time.perf_counter() - t0)

    prepare_s: list[float] = []
    real_prepare = runner.prepare

    def timed_prepare(*args, **kw):
        t0 = time.perf_counter()
        try:
            return real_prepare(*args, **kw)
        finally:
            prepare_s.append(time.perf_counter() - t0)

    runner.run = timed_run  # type: ignore[method-assign]
    runner.prepare = timed_prepare  # type: ignore[method-assign]
    pool = ThreadPoolExecutor(2)
    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds * 1e6)

    def encode() -> list[list[int]]:
        return prompts.encode_embedding_inputs(runner.tokenizer, [query], prompt="", max_length=512, truncate=True)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        scheds = {}
        for inline in (False, True):
            scheds[inline] = Scheduler(runner, max_batch_tokens=16384, inline=inline)
            scheds[inline].start()
        try:
            for _ in range(reps):
                t0 = time.perf_counter()
                parse_bytes(body, EmbedRequest, max_items=2048)
                add("parse + validate body", time.perf_counter() - t0)
                t0 = time.perf_counter()
                items = encode()
                add("tokenize (inline)", time.perf_counter() - t0)
                t0 = time.perf_counter()
                await loop.run_in_executor(pool, encode)
                add("tokenize (thread hop)", time.perf_counter() - t0)
                for inline in (False, True):
                    forward_s.clear()
                    prepare_s.clear()
                    t0 = time.perf_counter()
                    res = await scheds[inline].submit([list(items[0])])
                    total = time.perf_counter() - t0
                    add("prepare (runner.prepare)", prepare_s[0])
                    add("forward (runner.run)", forward_s[0])
                    add(f"queue + form + {'run on prep thread' if inline else 'hand-over'} + resolve",
                        total - forward_s[0] - prepare_s[0])
                t0 = time.perf_counter()
                vec = shape_vectors(res.outputs, dimensions=None, normalize=True)
                add("shape (normalize)", time.perf_counter() - t0)
                t0 = time.perf_counter()
                json.dumps(vec.tolist(), separators=(",", ":")).encode()
                add("render (json.dumps of tolist)", time.perf_counter() - t0)
                t0 = time.perf_counter()
                encoding.float_array(vec)
                add("render (orjson, float64 slices)", time.perf_counter() - t0)
        finally:
            for sch in scheds.values():
                sch.stop()

    asyncio.run(go())
    pool.shutdown()
    return [{"hop": k, "p50_us": round(statistics.median(v), 1), "p90_us": round(_quantile(v, 0.9), 1)}
            for k, v in rows.items()]


def _http(sock, method: str, path: str, body: bytes = b"") -> tuple[float, dict]:
    """One keep-alive HTTP/1.1 exchange on a raw socket: (ms, headers); no client library's cost."""
    head = (f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    t0 = time.perf_counter()
    sock.sendall(head + body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    raw, _, rest = buf.partition(b"\r\n\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.decode().partition(":") for line in raw.split(b"\r\n")[1:])}
    while len(rest) < int(headers["content-length"]):
        rest += sock.recv(65536)
    return (time.perf_counter() - t0) * 1e3, headers


ONE_INPUT = "Instruct: Given a web search query, retrieve relevant passages\nQuery: what is the capital of france"
# route name -> (path, body): TEI's /embed, or OpenAI's /v1/embeddings (what Infinity serves with
# `--url-prefix /v1`; its model name must then be given with --model).
ONE_INPUT_ROUTES = {"embed": "/embed", "openai": "/v1/embeddings"}


def one_input(urls: dict[str, str], *, requests: int = 1000, route: str = "embed",
              model: str | None = None) -> list[dict]:
    """c1 keep-alive latency of a one-input embedding request and of /health per server, alternating
    request by request (in a shuffled order each round: loadtest.alternate.turn_order), over raw
    sockets."""
    import socket
    from urllib.parse import urlsplit

    path = ONE_INPUT_ROUTES[route]
    payload: dict = {"inputs": ONE_INPUT} if route == "embed" else {"input": ONE_INPUT}
    if model is not None and route == "openai":
        payload["model"] = model
    body = json.dumps(payload).encode()
    socks = {}
    for name, url in urls.items():
        u = urlsplit(url)
        socks[name] = socket.create_connection((u.hostname, u.port or 80))
        socks[name].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    got: dict[str, dict[str, list[float]]] = {n: {"embed": [], "health": []} for n in urls}
    names = list(urls)
    for i in range(requests):
        for name in (names[k] for k in turn_order(i, len(names))):
            got[name]["health"].append(_http(socks[name], "GET", "/health")[0])
            got[name]["embed"].append(_http(socks[name], "POST", path, body)[0])
    for s in socks.values():
        s.close()
    return [{"target": n, "embed_p50_ms": round(statistics.median(v["embed"]), 2),
             "embed_p99_ms": round(_quantile(v["embed"], 0.99), 2),
             "health_p50_ms": round(statistics.median(v["health"]), 2)} for n, v in got.items()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_front", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("big-answer")
    b.add_argument("--url", required=True)
    b.add_argument("--inputs", type=int, default=2048)
    b.add_argument("--route", default="/embed")
    s = sub.add_parser("switch-interval")
    s.add_argument("--preset", default="qwen3-0.6b")
    s.add_argument("--layers", type=int, default=2)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--intervals", type=float, nargs="+", default=[5.0, 2.0, 1.0, 0.5], help="milliseconds")
    h = sub.add_parser("hops")
    h.add_argument("--preset", default="tiny-embedding")
    h.add_argument("--reps", type=int, default=300)
    o = sub.add_parser("one-input")
    o.add_argument("--target", action="append", required=True, metavar="NAME=URL")
    o.add_argument("--requests", type=int, default=1000)
    o.add_argument("--route", choices=sorted(ONE_INPUT_ROUTES), default="embed")
    o.add_argument("--model", default=None, help="the body's model name (openai route)")
    f = sub.add_parser("forward-rate")
    f.add_argument("--model-dir", required=True)
    f.add_argument("--queries", type=int, default=64)
    f.add_argument("--radix-mlp-threshold", type=float, default=1.0)
    f.add_argument("--prefix-cache-size", default="0")
    a = ap.parse_args(argv)
    if a.cmd == "forward-rate":
        print(json.dumps(forward_rate(a.model_dir, queries=a.queries, threshold=a.radix_mlp_threshold,
                                      cache=a.prefix_cache_size)))
    elif a.cmd == "one-input":
        host = machine.current()
        for row in one_input(dict(t.split("=", 1) for t in a.target), requests=a.requests, route=a.route,
                             model=a.model):
            print(json.dumps(row))
        print(json.dumps({"machine": machine.finish(host)}))
    elif a.cmd == "hops":
        for row in hops(preset=a.preset, reps=a.reps):
            print(json.dumps(row))
    elif a.cmd == "big-answer":
        print(json.dumps(big_answer(a.url, inputs=a.inputs, route=a.route), indent=1))
    else:
        for row in switch_interval(preset=a.preset, layers=a.layers, rounds=a.rounds,
                                   intervals=tuple(x / 1e3 for x in a.intervals)):
            print(json.dumps(row))


if __name__ == "__main__":
    main()

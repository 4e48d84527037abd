"""Front-end benchmarks: what a big answer does to everyone else, and the GIL's switch interval.

    python -m benchmarks.bench_front big-answer --url http://127.0.0.1:8080 [--inputs 2048]
    python -m benchmarks.bench_front switch-interval [--preset qwen3-0.6b --layers 2]

``big-answer`` (HTTP only): one request with ``--inputs`` short inputs (float JSON, 2048 x the
hidden size) while /health is probed every 20 ms and one-input requests run back to back; prints
/health p50/p99/max during the big request, and the one-input requests' front-end time (client
latency less their queue and forward time from the x-* headers) alone and during it.
``switch-interval`` (in process): the forward of a small batch on the worker thread while threads
parse request bodies and tokenize (the server's busy Python), for several ``sys.setswitchinterval``
values, interleaved round by round; prints forward ms and the background work done.
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
    """Forward ms of a one-item batch on a worker thread while ``busy_threads`` parse and tokenize."""
    import numpy as np

    import models
    from models import fixtures, prompts
    from server.http.bodies import parse_bytes
    from server.routes.schemas import EmbedRequest

    runner = models.load_runner(str(fixtures.cached(preset, layers=layers)), device="cpu", dtype="float32",
                                prefix_cache_size=0)
    ids = np.arange(100, 116, dtype=np.int32)
    cu = np.array([0, 16], np.int32)
    body = json.dumps({"inputs": [f"a body of text number {i} to parse" for i in range(512)]}).encode()
    texts = [f"tokenize this text of some length, number {i}" for i in range(64)]
    stop = threading.Event()
    work = [0]

    def busy() -> None:
        while not stop.is_set():
            parsed = parse_bytes(body, EmbedRequest, max_items=2048)
            prompts.encode_embedding_inputs(runner.tokenizer, texts, prompt="", max_length=512, truncate=True,
                                            direction="right")
            work[0] += len(parsed.inputs)

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(busy_threads)]
    for t in threads:
        t.start()
    old = sys.getswitchinterval()
    times: dict[float, list[float]] = {i: [] for i in intervals}
    done: dict[float, int] = {i: 0 for i in intervals}
    spent: dict[float, float] = {i: 0.0 for i in intervals}
    try:
        for _ in range(rounds):
            for interval in intervals:
                sys.setswitchinterval(interval)
                w0, t0 = work[0], time.perf_counter()
                for _ in range(per_round):
                    s = time.perf_counter()
                    runner.run(runner.prepare(ids, cu))
                    times[interval].append((time.perf_counter() - s) * 1e3)
                done[interval] += work[0] - w0
                spent[interval] += time.perf_counter() - t0
    finally:
        stop.set()
        sys.setswitchinterval(old)
    return [{"switch_interval_ms": i * 1e3, "forward_p50_ms": statistics.median(times[i]),
             "forward_p90_ms": _quantile(times[i], 0.9), "background_bodies_per_s": done[i] / spent[i]}
            for i in intervals]


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
    a = ap.parse_args(argv)
    if a.cmd == "big-answer":
        print(json.dumps(big_answer(a.url, inputs=a.inputs, route=a.route), indent=1))
    else:
        for row in switch_interval(preset=a.preset, layers=a.layers, rounds=a.rounds,
                                   intervals=tuple(x / 1e3 for x in a.intervals)):
            print(json.dumps(row))


if __name__ == "__main__":
    main()

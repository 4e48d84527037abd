"""What one request executes in process: its Python bytecodes (every thread), or its CPU time with
the caches warm and with them evicted.

    python -m benchmarks.bench_pycount [--preset tiny-embedding | --model-dir DIR] [--requests 50] [--top K]
    python -m benchmarks.bench_pycount --cpu [--evict 8] [--requests 2000]

The server's app in process (``create_app`` on the preset's fixture, the zero-cost forward of
benchmarks/host_child.py, direct ASGI calls on uvloop, no sockets), warmed up, then ``--requests``
requests of ``GET /health`` and of a one-input ``/v1/embeddings`` (the instructed query of
benchmarks/bench_front.py) traced opcode by opcode (``sys.settrace`` with ``f_trace_opcodes``,
``threading.settrace``). Prints each route's bytecodes per request and the embedding request's
excess over ``/health``; ``--top K`` adds the K functions that execute the most of the embedding
request's. C code (the tokenizer, numpy, torch, the event loop) is not counted.

What it is for: the lone request's fixed cost over ``/health`` is a few hundred microseconds of
mostly Python spread over some fifty functions, each paid at an idle CPU's pace
(docs/performance/latency.md), so a change that removes a few operations moves the socket
benchmark by less than its run-to-run spread. The count moves only with the code a request runs
(within a few bytecodes: a lone-path trial one batch in 256, a timer), so it says what a change
removed; the socket benchmark says what that is worth on a machine.

``--cpu`` times the same two requests instead (no trace): the process's CPU time per request
(``time.process_time``, every thread; the lone request runs on the loop), in rounds that take
turns between the caches as the previous request left them ("warm") and after ``--evict`` MiB were
written just before each request ("evicted": what a neighbour's work, another server's turn in
the socket benchmark, leaves). Prints the median of each, and the embedding request's excess
over ``/health`` both ways: how much of the socket benchmark's excess is the code's cost and how
much the pace of caches it finds cold. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import statistics
import threading
import time


async def _call(app, path: str, method: str = "GET", payload: bytes = b"") -> int:
    """One ASGI request to ``app``; its status."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    sent = False
    status: list[int] = []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the answer comes first

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    return status[0]


class Counter:
    """A trace function counting opcodes, in all and by (file, function)."""

    def __init__(self, by_function: bool) -> None:
        self.total = 0
        self.by_function: collections.Counter = collections.Counter()
        self._by = by_function
        self._root = os.getcwd() + os.sep

    def __call__(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.total += 1
            if self._by:
                code = frame.f_code
                where = code.co_filename.split("site-packages" + os.sep)[-1].replace(self._root, "")
                self.by_function[f"{where}:{code.co_name}"] += 1
        return self


def _calls() -> dict:
    from benchmarks.bench_front import ONE_INPUT

    body = json.dumps({"input": ONE_INPUT, "model": "tiny"}).encode()
    return {"/health": ("GET", b""), "/v1/embeddings": ("POST", body)}


async def _warm(app, calls: dict) -> None:
    for _ in range(300):  # kernels built, the lone path measured, caches filled
        for path, (method, payload) in calls.items():
            assert await _call(app, path, method, payload) == 200, path


async def measure(app, requests: int, top: int) -> dict:
    calls = _calls()
    out: dict = {}
    async with app.router.lifespan_context(app):
        await _warm(app, calls)
        for path, (method, payload) in calls.items():
            counter = Counter(by_function=top > 0 and path != "/health")
            threading.settrace(counter)
            sys.settrace(counter)
            try:
                for _ in range(requests):
                    await _call(app, path, method, payload)
            finally:
                sys.settrace(None)
                threading.settrace(None)
            out[path] = counter.total / requests
            if counter.by_function:
                out["top"] = [(name, n / requests) for name, n in counter.by_function.most_common(top)]
    return out


async def cpu_times(app, requests: int, evict_mib: int) -> dict:
    """Median CPU seconds per request by (route, "warm" | "evicted"), the rounds taking turns."""
    import numpy as np

    calls = _calls()
    scratch = np.zeros(max(evict_mib, 1) << 20, dtype=np.uint8)  # written whole to evict the caches
    spent: dict = collections.defaultdict(list)
    async with app.router.lifespan_context(app):
        await _warm(app, calls)
        for _ in range(requests):
            for state in ("warm", "evicted"):
                for path, (method, payload) in calls.items():
                    if state == "evicted":
                        scratch += 1
                    t0 = time.process_time()
                    await _call(app, path, method, payload)
                    spent[path, state].append(time.process_time() - t0)
    return {key: statistics.median(values) for key, values in spent.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-embedding")
    parser.add_argument("--model-dir", default=None, help="an embedding checkpoint instead of the preset's fixture")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--top", type=int, default=0, help="also list the K functions that execute the most")
    parser.add_argument("--cpu", action="store_true", help="time each request's CPU, warm and evicted, instead")
    parser.add_argument("--evict", type=int, default=8, metavar="MIB",
                        help="--cpu: MiB written before each evicted request")
    args = parser.parse_args(argv)

    import uvloop

    import fixtures
    from benchmarks.host_child import zero_forward
    from server.app import create_app, load_runner
    from server.cli import parse_config

    where = args.model_dir if args.model_dir is not None else str(fixtures.cached(args.preset))
    config = parse_config(["--model-id", where, "--served-model-name", "tiny"])
    runner = load_runner(config)
    zero_forward(runner, {})
    app = create_app(config, runner=runner)
    if args.cpu:
        times = uvloop.run(cpu_times(app, args.requests, args.evict))
        for state in ("warm", "evicted"):
            health, embed = times["/health", state] * 1e6, times["/v1/embeddings", state] * 1e6
            print(f"CPU per request, {state}{f' ({args.evict} MiB written before each)' if state == 'evicted' else ''}:"
                  f" /health {health:.0f} us, one-input /v1/embeddings {embed:.0f} us, excess {embed - health:.0f} us"
                  f" (median of {args.requests})")
        return times
    result = uvloop.run(measure(app, args.requests, args.top))
    health, embed = result["/health"], result["/v1/embeddings"]
    print(f"bytecodes per request: /health {health:.0f}, one-input /v1/embeddings {embed:.0f}, "
          f"excess {embed - health:.0f} ({args.requests} requests each)")
    for name, n in result.get("top", []):
        print(f"{n:9.1f}  {name}")
    return result


if __name__ == "__main__":
    main()

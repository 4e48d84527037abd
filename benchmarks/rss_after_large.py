"""RSS after large requests on glibc, and what ``malloc_trim`` (server/allocator.py) gives back.

    python -m benchmarks.rss_after_large

Serves the tiny embedding fixture in-process with the server's own trim off, sends three /embed
requests of 2,048 distinct ~160-token inputs, prints VmRSS after each, then calls
``release_free_memory`` once and prints its time and the RSS after it (docs/operations.md).
"""
from __future__ import annotations

import time

import httpx

import fixtures
from server import allocator
from server.service import core
from tests.limits import _status_kb
from tests.serving import serve

W = "lorem ipsum dolor sit amet "


def main() -> None:
    core.TRIM_AFTER_BYTES = 1 << 62  # the server's own trim off: measure what glibc keeps
    srv = serve(str(fixtures.cached("tiny-embedding")), max_client_batch_size=2048,
                max_input_length=1024)
    httpx.post(srv.url + "/embed", json={"inputs": "warm"}, timeout=600)
    print("idle RSS MB", _status_kb("VmRSS") / 1024)
    for k in range(3):
        r = httpx.post(srv.url + "/embed", json={"inputs": [f"{k} {i} " + W * 30 for i in range(2048)]}, timeout=900)
        print("after /embed", k, r.status_code, "RSS MB", _status_kb("VmRSS") / 1024, flush=True)
    t0 = time.perf_counter()
    ok = allocator.release_free_memory()
    dt = time.perf_counter() - t0
    print("malloc_trim", ok, f"{dt*1000:.0f} ms", "RSS MB", _status_kb("VmRSS") / 1024, flush=True)
    srv.stop()


if __name__ == "__main__":
    main()

"""Measuring the work a request makes the server do, as limits a test can assert (Linux).

CPU: ``resource.getrusage`` of this process (the test's ServerThread runs in it). Memory: the
process's peak RSS, reset before the measured call (``/proc/self/clear_refs``), so Rust and C
allocations (tokenizers, JSON) count too, which tracemalloc would miss.
"""
from __future__ import annotations

import resource

import pytest


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def measure(fn):
    """(result of fn(), CPU seconds, peak RSS growth in MB) of one call."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pytest.skip("cannot reset the peak RSS on this system")
    before_rss = _status_kb("VmRSS")
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    out = fn()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return out, cpu, (_status_kb("VmHWM") - before_rss) / 1024


def main() -> None:
    """Print CPU-seconds and peak RSS growth of ~2 MB requests against the tiny fixtures
    (``python -m tests.limits``; the figures docs/operations.md quotes)."""
    import httpx

    import fixtures
    from tests.serving import ServerThread, serve

    def server(preset: str) -> ServerThread:
        model_dir = str(fixtures.cached(preset))
        return serve(model_dir, max_client_batch_size=64, max_input_length=512, allow_token_ids=True)

    words = "lorem ipsum dolor sit amet "
    docs = [f"document {i} about something" for i in range(64)]
    cases = {
        "tiny-reranker": [
            ("/rerank", {"query": words * 70_000, "texts": docs, "truncate": True}),
            ("/rerank", {"query": "7" * 1_900_000, "texts": docs, "truncate": False}),
            ("/rerank", {"query": "7" * 1_900_000, "texts": docs, "truncate": True}),
        ],
        "tiny-embedding": [
            ("/embed", {"inputs": [words * 1_100] * 64, "truncate": True}),
            ("/tokenize", {"inputs": [words * 1_100] * 64}),
            ("/v1/embeddings", {"input": list(range(1000, 1000 + 250_000))}),
            ("/v1/embeddings", {"input": [[1]] * 380_000}),
            ("/embed", {"inputs": ["[{"] * 300_000}),
        ],
    }
    print("| route | body | status | CPU s | peak RSS growth MB |")
    print("|---|---|---|---|---|")
    for preset, requests in cases.items():
        srv = server(preset)
        try:
            with httpx.Client(base_url=srv.url, timeout=300) as client:
                client.post(requests[0][0], json={"query": "warm", "texts": ["up"]} if "rerank" in requests[0][0]
                            else {"inputs": "warm up"})
                for path, body in requests:
                    raw = httpx.Request("POST", "/", json=body).read()
                    r, cpu, growth = measure(lambda: client.post(
                        path, content=raw, headers={"content-type": "application/json"}))
                    shape = ", ".join(f"{k}={_shape(v)}" for k, v in body.items())
                    print(f"| {path} | {len(raw) / 1e6:.2f} MB: {shape} | {r.status_code} | {cpu:.2f} | {growth:.0f} |")
        finally:
            srv.stop()


def _shape(value) -> str:
    if isinstance(value, str):
        return f"{len(value)} chars"
    if isinstance(value, list):
        return f"[{len(value)}]"
    return str(value)


if __name__ == "__main__":
    main()

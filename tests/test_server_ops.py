"""Operational behaviour: overload (429), client disconnects, a failing batch (500 for that batch
only), a dead worker (503) and the Prometheus metrics."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.config import ServerConfig
from tests.serving import ServerThread, cached_runner


def slow(runner, delay: float):
    """A copy of the runner whose forward takes at least ``delay`` seconds."""
    copy = dataclasses.replace(runner)
    inner = copy.run

    def run(batch):
        time.sleep(delay)
        return inner(batch)

    copy.run = run
    return copy


@pytest.fixture(scope="module")
def base(tiny_embedding_dir):
    return cached_runner(str(tiny_embedding_dir))


def _start(runner, model_dir, **overrides) -> ServerThread:
    return ServerThread(create_app(ServerConfig(model_id=str(model_dir), **overrides), runner=runner)).start()


def metric(url: str, name: str, **labels) -> float:
    """A series' value summed over the other labels. NOTE: prometheus_client's parser names a
    counter's samples NAME_total even where the text (TEI's te_request_*) says NAME."""
    text = httpx.get(url + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, name + "_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_overload_gets_429_at_once(base, tiny_embedding_dir):
    srv = _start(slow(base, 0.4), tiny_embedding_dir, max_concurrent_requests=8, max_client_batch_size=8,
                 max_batch_requests=4)
    try:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                async def one(i):
                    t0 = time.monotonic()
                    r = await c.post("/embed", json={"inputs": [f"text {i} {j}" for j in range(4)]})
                    return r, time.monotonic() - t0

                return await asyncio.gather(*(one(i) for i in range(6)))

        results = asyncio.run(main())
        codes = [r.status_code for r, _ in results]
        assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
        for r, _ in results:
            if r.status_code == 429:
                assert r.json()["error_type"] == "Overloaded"
            else:
                assert len(r.json()) == 4
        # Refused, not queued: every 429 arrives before the first 200, which waits for a 0.4 s forward.
        refused = max(elapsed for r, elapsed in results if r.status_code == 429)
        served = min(elapsed for r, elapsed in results if r.status_code == 200)
        assert refused < served, (refused, served)
        assert srv_permits(srv) == 0
        assert httpx.post(srv.url + "/embed", json={"inputs": ["after"] * 4}, timeout=60).status_code == 200
    finally:
        srv.stop()


def srv_permits(srv: ServerThread) -> int:
    return srv.server.config.app.state.service.permits.in_use


def test_client_disconnect_mid_queue(base, tiny_embedding_dir):
    srv = _start(slow(base, 0.3), tiny_embedding_dir, max_batch_requests=1)
    try:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                async def impatient(i):
                    try:
                        await c.post("/embed", json={"inputs": f"impatient {i}"}, timeout=0.1)
                    except httpx.TimeoutException:
                        return "gone"
                    return "served"

                patient = asyncio.gather(*(c.post("/embed", json={"inputs": f"patient {i}"}) for i in range(3)))
                gone = asyncio.gather(*(impatient(i) for i in range(4)))
                return await patient, await gone

        patient, gone = asyncio.run(main())
        assert all(r.status_code == 200 and len(r.json()) == 1 for r in patient)
        assert "gone" in gone
        deadline = time.monotonic() + 600  # catches a hang only
        while srv_permits(srv) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv_permits(srv) == 0
        assert metric(srv.url, "te_request_failure", err="client_gone") >= 1
        assert httpx.post(srv.url + "/embed", json={"inputs": "later"}, timeout=60).status_code == 200
    finally:
        srv.stop()


def test_failing_batch_is_500_only_for_that_batch(base, tiny_embedding_dir):
    runner = dataclasses.replace(base)
    inner, calls = runner.run, []

    def run(batch):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return inner(batch)

    runner.run = run
    srv = _start(runner, tiny_embedding_dir)
    try:
        bad = httpx.post(srv.url + "/embed", json={"inputs": ["a", "b"]}, timeout=60)
        assert bad.status_code == 500 and bad.json()["error_type"] == "Backend"
        assert "injected failure" not in bad.text and bad.headers["x-request-id"] in bad.json()["error"]
        good = httpx.post(srv.url + "/embed", json={"inputs": ["a", "b"]}, timeout=60)
        assert good.status_code == 200, good.text
        ref = base.run(base.prepare(*_pack(base, ["a", "b"])))
        np.testing.assert_allclose(good.json(), ref.numpy() / np.linalg.norm(ref.numpy(), axis=1, keepdims=True), atol=1e-4)
        assert httpx.get(srv.url + "/health").status_code == 200
        assert metric(srv.url, "te_request_failure", err="backend") == 1
    finally:
        srv.stop()


def _pack(runner, texts):
    ids = [runner.tokenizer.encode(t).ids for t in texts]
    cu = np.cumsum([0] + [len(i) for i in ids]).astype(np.int32)
    return np.array([t for seq in ids for t in seq], dtype=np.int32), cu


def test_dead_worker_is_503(base, tiny_embedding_dir):
    srv = _start(base, tiny_embedding_dir)
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        srv.server.config.app.state.service.scheduler.stop(drain=True)
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/embed", json={"inputs": "x"})
        assert r.status_code == 503 and r.json()["error_type"] == "Unhealthy"
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    finally:
        srv.stop()


def test_metrics_parse_and_move(base, tiny_embedding_dir):
    srv = _start(base, tiny_embedding_dir)
    try:
        before = metric(srv.url, "te_request_count", method="embed")
        r = httpx.post(srv.url + "/embed", json={"inputs": ["shared prefix a", "shared prefix b"]}, timeout=60)
        assert r.status_code == 200
        httpx.post(srv.url + "/embed", json={"inputs": ""})
        assert metric(srv.url, "te_request_count", method="embed") == before + 2
        assert metric(srv.url, "te_request_success", method="embed") == 1
        assert metric(srv.url, "te_request_failure", err="empty") == 1
        for name in ("te_request_duration_count", "te_request_tokenization_duration_count",
                     "te_request_queue_duration_count", "te_request_inference_duration_count"):
            assert metric(srv.url, name) >= 1, name
        assert metric(srv.url, "radixserve_tokens_total", kind="original") >= int(r.headers["x-compute-tokens"])
        names = {f.name for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
        assert {"te_queue_size", "te_batch_next_size", "te_radix_mlp_compression_ratio"} <= names
    finally:
        srv.stop()

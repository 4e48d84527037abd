"""``--api-server-count 2``: real CLI processes (an engine and two front ends) against the
single-process server on the same checkpoint.

The answers equal the single-process ones (embeddings on /embed and /v1/embeddings, a rerank);
requests land on both front ends (``x-radixserve-frontend``) and one /metrics scrape counts them
all; auth, request ids and cache_salt namespaces hold across the processes; SIGTERM drains an
in-flight request and exits 0; a killed engine takes the front ends down (never a 200 /health
after it), and a killed front end or a dead model worker stops the server with ``EXIT_WORKER_DEAD``.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from server.http.lifecycle import EXIT_WORKER_DEAD
from tests.serving import free_port, serve
from tests.test_server_lifecycle import Proc

KEY = "frontends-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
TEXTS = ["the first text", "a second, longer text about prefixes", "third"]


def test_merged_metrics_sum_every_process():
    from scheduler.metrics import Metrics
    from server.frontends import metrics_merge

    a, b, engine = Metrics(), Metrics(), Metrics()
    a.request_count.labels(method="embed").inc(3)
    b.request_count.labels(method="embed").inc(4)
    b.request_count.labels(method="rerank").inc()
    a.request_duration.observe(0.002)
    b.request_duration.observe(0.2)
    engine.batch_next_size.observe(8)
    engine.queue_size.set(5)
    text = metrics_merge.exposition(metrics_merge.merge(
        [list(m.registry.collect()) for m in (engine, a, b)])).decode()
    assert _counter(text, "te_request_count", "embed") == 7 and _counter(text, "te_request_count", "rerank") == 1
    assert "# TYPE te_request_count counter" in text
    assert re.search(r"^te_request_duration_count 2\.0$", text, flags=re.M)
    assert re.search(r'^te_request_duration_bucket\{le="0\.0025"\} 1\.0$', text, flags=re.M)
    assert re.search(r"^te_batch_next_size_count 1\.0$", text, flags=re.M)
    assert re.search(r"^te_queue_size 5\.0$", text, flags=re.M)


def test_host_normalization_equals_the_models():
    from models import pooling
    from server.service.results import l2_normalize

    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    for d in (None, 1, 17, 64):
        assert np.array_equal(l2_normalize(x, d), pooling.normalize(x, d))


def _children(pid: int) -> list[int]:
    """The front ends: processes whose parent is the engine."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout  # catches a hang only
    while any(_running(p) for p in pids):
        assert time.monotonic() < deadline, f"front ends still running: {pids}"
        time.sleep(0.1)


def _serving(url: str, count: int = 2) -> None:
    """Until every front end answers: each listens once its server runs, the first may be alone."""
    seen: set[str] = set()
    deadline = time.monotonic() + 300  # catches a hang only
    while len(seen) < count:
        assert time.monotonic() < deadline, f"front ends serving: {seen}"
        seen.add(httpx.get(url + "/health", timeout=30).headers["x-radixserve-frontend"])


def _counter(text: str, name: str, method: str) -> float:
    m = re.search(rf'^{name}{{method="{method}"}} (\S+)$', text, flags=re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def uds_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("uds") / "radixserve.sock")


@pytest.fixture(scope="module")
def prometheus_port():
    return free_port()


@pytest.fixture(scope="module")
def embed_pair(tiny_embedding_dir, uds_path, prometheus_port):
    """(the two-front-end server, also on a unix socket and a --prometheus-port, the single-process
    server), both with the API key."""
    multi = Proc(tiny_embedding_dir, "--api-server-count", "2", "--api-key", KEY, "--uds-path", uds_path,
                 "--prometheus-port", str(prometheus_port))
    _serving(multi.url)
    single = serve(tiny_embedding_dir, api_key=KEY, max_batch_tokens=512)
    try:
        yield multi, single
    finally:
        single.stop()
        if multi.proc.poll() is None:
            multi.proc.kill()
            multi.proc.communicate()


def test_embeddings_equal_the_single_process_server(embed_pair):
    multi, single = embed_pair
    for path, body in (("/embed", {"inputs": TEXTS}), ("/v1/embeddings", {"input": TEXTS})):
        got = httpx.post(multi.url + path, json=body, headers=AUTH, timeout=60)
        want = httpx.post(single.url + path, json=body, headers=AUTH, timeout=60)
        assert got.status_code == want.status_code == 200, got.text
        if path == "/embed":
            a, b = np.array(got.json()), np.array(want.json())
        else:
            a = np.array([d["embedding"] for d in got.json()["data"]])
            b = np.array([d["embedding"] for d in want.json()["data"]])
            assert got.json()["usage"] == want.json()["usage"]
        assert a.shape == b.shape == (len(TEXTS), a.shape[1])
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_requests_land_on_both_front_ends_and_metrics_sum_them(embed_pair, prometheus_port):
    multi, _ = embed_pair
    before = httpx.get(multi.url + "/metrics", timeout=60).text
    served = []
    for i in range(48):  # a new connection each: the kernel hashes each to one front end
        r = httpx.post(multi.url + "/embed", json={"inputs": f"request {i}"}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        served.append(r.headers["x-radixserve-frontend"])
    assert set(served) == {"0", "1"}, served
    after = httpx.get(multi.url + "/metrics", timeout=60).text
    for name in ("te_request_count", "te_request_success"):
        assert _counter(after, name, "embed") - _counter(before, name, "embed") == len(served), name
    # the engine's series are in the same scrape: one batch or more per request
    batches = [float(m) for m in re.findall(r"^te_batch_next_size_count (\S+)$", after, flags=re.M)]
    assert len(batches) == 1 and batches[0] >= len(served)
    side = httpx.get(f"http://127.0.0.1:{prometheus_port}/metrics", timeout=60).text  # the engine serves it
    assert _counter(side, "te_request_count", "embed") == _counter(after, "te_request_count", "embed")
    assert httpx.get(f"http://127.0.0.1:{prometheus_port}/health", timeout=60).status_code == 200


def test_auth_request_ids_and_info(embed_pair, uds_path):
    multi, single = embed_pair
    body = {"inputs": "hello"}
    assert httpx.post(multi.url + "/embed", json=body, timeout=60).status_code == 401
    assert httpx.post(multi.url + "/embed", json=body, headers={"authorization": "Bearer wrong"},
                      timeout=60).status_code == 401
    r = httpx.post(multi.url + "/embed", json=body, headers={**AUTH, "x-request-id": "frontends-42"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "frontends-42"
    too_many = {"inputs": ["x"] * 2049}
    assert httpx.post(multi.url + "/embed", json=too_many, headers=AUTH, timeout=60).status_code == 422
    info, one = (httpx.get(s.url + "/info", timeout=60).json() for s in (multi, single))
    assert info["api_server_count"] == 2 and one["api_server_count"] == 1
    assert set(info) == set(one)
    stable = ("model_id", "served_model_name", "auto_truncate", "tokenization_workers", "prompts", "model_dtype",
              "model_type", "head", "routes", "max_concurrent_requests", "max_input_length", "max_batch_tokens",
              "max_client_batch_size", "radix_mlp_threshold", "radix_attention", "batching_policy", "version")
    assert {k: info[k] for k in stable} == {k: one[k] for k in stable}  # the rest is measured at each load
    deadline = time.monotonic() + 120  # catches a hang only: the engine sends its stages once warm
    while "total" not in info["startup"]:
        assert time.monotonic() < deadline, info["startup"]
        time.sleep(0.1)
        info = httpx.get(multi.url + "/info", timeout=60).json()
    assert "warm-up" in info["startup"]
    with httpx.Client(transport=httpx.HTTPTransport(uds=uds_path)) as c:  # one socket both front ends accept on
        r = c.post("http://radixserve/embed", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.headers["x-radixserve-frontend"] in ("0", "1")


def test_cache_salt_namespaces_hold_across_processes(embed_pair):
    multi, _ = embed_pair
    text = "A shared preamble that both tenants send, long enough to be cached in blocks of tokens. " * 3

    def computed(salt: str) -> int:
        r = httpx.post(multi.url + "/embed", json={"inputs": text, "cache_salt": salt}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return int(r.headers["x-compute-tokens"])

    first = computed("tenant-a")
    assert computed("tenant-a") < first  # the same namespace reads its own cached prefix
    assert computed("tenant-b") == first  # another one finds nothing


def _health_until(url: str, healthy: bool, bound: float = 180.0) -> int:
    """Poll /health until it answers 200 (``healthy``) or anything else; the bound catches a hang only."""
    deadline = time.monotonic() + bound
    while True:
        assert time.monotonic() < deadline, f"/health never turned {'200' if healthy else 'non-200'}"
        try:
            code = httpx.get(url + "/health", timeout=60).status_code
        except httpx.TransportError:
            code = 0
        if (code == 200) == healthy:
            return code
        time.sleep(0.05)


def test_a_stopped_engine_turns_the_front_ends_health_non_200(embed_pair):
    """SIGSTOP the engine: the front ends, still running, answer /health 503 (the engine's ping
    goes unanswered); SIGCONT: 200 again."""
    multi, _ = embed_pair
    _health_until(multi.url, healthy=True)
    os.kill(multi.proc.pid, signal.SIGSTOP)
    try:
        assert _health_until(multi.url, healthy=False) == 503
        assert all(_running(p) for p in _children(multi.proc.pid))
    finally:
        os.kill(multi.proc.pid, signal.SIGCONT)
    _health_until(multi.url, healthy=True)


def test_a_killed_engine_takes_the_front_ends_down(embed_pair):
    multi, _ = embed_pair
    frontends = _children(multi.proc.pid)
    assert len(frontends) == 2
    multi.proc.kill()
    multi.proc.wait()
    seen = []
    deadline = time.monotonic() + 120  # catches a hang only
    while any(_running(p) for p in frontends) and time.monotonic() < deadline:
        try:
            seen.append(httpx.get(multi.url + "/health", timeout=5).status_code)
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    _wait_gone(frontends)
    assert all(code == 503 for code in seen), seen
    with pytest.raises(httpx.TransportError):
        httpx.get(multi.url + "/health", timeout=5)


def test_rerank_equals_single_process_and_sigterm_drains(tiny_reranker_dir):
    multi = Proc(tiny_reranker_dir, "--api-server-count", "2", fault="slow_forward=0.5")
    try:
        _serving(multi.url)
        body = {"query": "what is a prefix?", "texts": TEXTS}
        single = serve(tiny_reranker_dir, max_batch_tokens=512)
        try:
            want = httpx.post(single.url + "/rerank", json=body, timeout=60)
        finally:
            single.stop()
        got = httpx.post(multi.url + "/rerank", json=body, timeout=60)
        assert got.status_code == want.status_code == 200, got.text
        key = lambda r: sorted((d["index"], d["score"]) for d in r.json())  # noqa: E731
        np.testing.assert_allclose(np.array(key(got)), np.array(key(want)), rtol=1e-5, atol=1e-6)

        frontends = _children(multi.proc.pid)
        results: dict = {}

        def post() -> None:
            results["r"] = httpx.post(multi.url + "/rerank", json=body, timeout=60)

        worker = threading.Thread(target=post)
        worker.start()
        while _counter(httpx.get(multi.url + "/metrics", timeout=60).text, "te_request_count", "rerank") < 2:
            time.sleep(0.02)  # until the request is in flight (counted on arrival)
        multi.proc.send_signal(signal.SIGTERM)
        worker.join(120)
        code, out = multi.wait(timeout=120)
    finally:
        if multi.proc.poll() is None:
            multi.proc.kill()
    assert results["r"].status_code == 200, results["r"].text
    np.testing.assert_allclose(np.array(key(results["r"])), np.array(key(want)), rtol=1e-5, atol=1e-6)
    assert code == 0, out
    assert "stopping (received SIGTERM)" in out and out.count("draining (received SIGTERM)") == 2, out
    _wait_gone(frontends)


def test_a_killed_front_end_stops_the_server_non_zero(tiny_embedding_dir):
    multi = Proc(tiny_embedding_dir, "--api-server-count", "2")
    try:
        _serving(multi.url)
        frontends = _children(multi.proc.pid)
        assert len(frontends) == 2
        os.kill(frontends[0], signal.SIGKILL)
        code, out = multi.wait(timeout=120)
    finally:
        if multi.proc.poll() is None:
            multi.proc.kill()
    assert code == EXIT_WORKER_DEAD, out
    assert re.search(rf"front end \d \(pid {frontends[0]}\) exited with status -9", out), out
    _wait_gone(frontends)


def test_a_dead_model_worker_drains_the_front_ends_and_exits_non_zero(tiny_embedding_dir):
    multi = Proc(tiny_embedding_dir, "--api-server-count", "2", fault="die_on_forward=2")
    try:
        _serving(multi.url)
        ok = httpx.post(multi.url + "/embed", json={"inputs": "fine"}, timeout=60)
        dead = httpx.post(multi.url + "/embed", json={"inputs": "fatal"}, timeout=60)
        frontends = _children(multi.proc.pid)
        code, out = multi.wait(timeout=120)
    finally:
        if multi.proc.poll() is None:
            multi.proc.kill()
    assert ok.status_code == 200
    assert dead.status_code == 503 and dead.json()["error_type"] == "Unhealthy"
    assert code == EXIT_WORKER_DEAD, out
    assert out.count("draining (the model worker died)") == 2 and "second SIGTERM" not in out, out
    _wait_gone(frontends)

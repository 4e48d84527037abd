"""``--api-server-count 2``: real CLI processes (an engine and two front ends) against the
single-process server on the same checkpoint.

The answers equal the single-process ones (embeddings on /embed and /v1/embeddings, a rerank);
requests land on both front ends (``x-radixserve-frontend``) and one /metrics scrape counts them
all; auth, request ids and cache_salt namespaces hold across the processes; SIGTERM drains an
in-flight request and exits 0; a killed engine takes the front ends down (never a 200 /health
after it), and a killed front end or a dead model worker stops the server with ``EXIT_WORKER_DEAD``.
"""
from __future__ import annotations

import asyncio
import os
import pickle
import re
import signal
import socket
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


def _loops() -> list:
    """pytest params: the event loops a channel runs on (asyncio's; uvloop's, which serves the httptools stack)."""
    try:
        import uvloop
        have = True
    except ImportError:
        have = False
    return [pytest.param(asyncio.new_event_loop, id="asyncio"),
            pytest.param(lambda: uvloop.new_event_loop(), id="uvloop",
                         marks=pytest.mark.skipif(not have, reason="uvloop not installed"))]


def _messages() -> list:
    rng = np.random.default_rng(0)
    return [("submit", 0, [[5, 6, 7], [1]], "rid-0", False, b""),
            ("cancel", 0),
            ("submit", 1, [list(range(70_000, 70_000 + 3000))], None, True, b"ns"),  # ids above 2**16
            ("result", 2, ("a", "<f4", (4, 64), 1, rng.standard_normal((4, 64)).astype(np.float32).tobytes()), 0.1,
             0.2, 9),
            ("big", rng.standard_normal(300_000).astype(np.float32).tobytes()),  # 1.2 MB: many reads
            *[("collect", i) for i in range(50)]]


class _CountingTransport:
    """A transport that counts its writes (uvloop's transports take no patched methods)."""

    def __init__(self, inner) -> None:
        self.inner, self.writes = inner, 0

    def write(self, data) -> None:
        self.writes += 1
        self.inner.write(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _same(a, b) -> bool:
    return pickle.dumps(a, protocol=5) == pickle.dumps(b, protocol=5)


@pytest.mark.parametrize("new_loop", _loops())
def test_channel_sends_a_burst_in_one_write_intact_and_in_order(new_loop):
    from server.frontends import wire

    sent = _messages()

    async def scenario() -> tuple[list, list, int]:
        a, b = socket.socketpair()
        got: list = []
        done = asyncio.get_running_loop().create_future()
        lost: list = []

        def received(msg) -> None:
            got.append(msg)
            if len(got) == len(sent) and not done.done():
                done.set_result(None)

        left = await wire.Channel.open(a, lambda msg: None, lost.append)
        right = await wire.Channel.open(b, received, lost.append)
        counter = left._transport = _CountingTransport(left._transport)
        for msg in sent:  # one loop iteration: one write
            left.send(msg)
        await asyncio.wait_for(done, 60)
        left.close()
        while len(lost) < 2:
            await asyncio.sleep(0.01)
        right.send(("after", "close"))  # nothing is sent after the end
        return got, lost, counter.writes

    loop = new_loop()
    try:
        got, lost, writes = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert writes == 1
    assert len(got) == len(sent) and all(_same(g, w) for g, w in zip(got, sent))
    assert len(lost) == 2  # each end saw the connection end once


def test_channel_parses_frames_split_anywhere():
    """Frames cut at every kind of boundary (inside the length, inside the payload, several per
    read) come out whole and in order, each once."""
    from server.frontends import wire

    sent = _messages()
    stream = b"".join(wire.frame(m) for m in sent)
    rng = np.random.default_rng(1)
    for trial in range(6):
        got: list = []
        loop = asyncio.new_event_loop()
        try:
            channel = loop.run_until_complete(_make_channel(got.append))
        finally:
            loop.close()
        cuts = sorted(set(rng.integers(0, len(stream), size=(1, 7, 50, 400, 3000, 20)[trial]).tolist()))
        for a, b in zip([0, *cuts], [*cuts, len(stream)]):
            channel.data_received(stream[a:b])
        assert len(got) == len(sent) and all(_same(g, w) for g, w in zip(got, sent)), trial


async def _make_channel(on_message):
    from server.frontends import wire

    return wire.Channel(on_message, lambda exc: None)


def test_outputs_travel_as_one_buffer_and_come_back_equal():
    from server.frontends import wire

    rng = np.random.default_rng(2)
    pooled = [rng.standard_normal(64).astype(np.float32) for _ in range(5)]
    states = [rng.standard_normal((7, 64)).astype(np.float32)]  # one item's [L, E]
    ragged = [rng.standard_normal((n, 8)).astype(np.float32) for n in (3, 1, 4)]
    scores = [0.25, -1.5, 3.0]
    for outputs in (pooled, states, ragged, scores, [np.float32(0.5)]):
        packed = pickle.loads(pickle.dumps(wire.pack_outputs(outputs), protocol=5))
        back = wire.unpack_outputs(packed)
        assert len(back) == len(outputs)
        for b, o in zip(back, outputs):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(o))
            assert np.asarray(b).dtype == np.asarray(o).dtype
            if isinstance(b, np.ndarray) and b.ndim:
                assert b.flags.writeable  # as a pickled array would be
    assert wire.pack_outputs(pooled)[0] == "a" and wire.pack_outputs(ragged)[0] == "l"


class _FakeScheduler:
    """The engine's scheduler: each item's output is its ids' sum and length (an independent
    computation the test repeats), released when the test says; cancellations are recorded."""

    alive = True
    queue_size = 0

    def __init__(self) -> None:
        self.release: asyncio.Event | None = None
        self.seen: list = []
        self.cancelled: list = []

    async def submit(self, items, *, request_id=None, all_tokens=False, namespace=b""):
        from scheduler import SubmitResult

        assert self.release is not None
        self.seen.append((request_id, all_tokens, namespace))
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        return SubmitResult([np.array([sum(i), len(i)], dtype=np.float32) for i in items], 0.5, 0.25, len(items))


def test_a_burst_of_submits_and_a_cancel_cross_the_wire():
    """RemoteScheduler -> Engine -> scheduler in one loop: 40 submits and a cancel sent in one
    iteration each get their own answer (the cancelled one reaches the scheduler's submit as a
    cancellation), request ids and namespaces arrive, and the engine's replies share writes."""
    from scheduler.metrics import Metrics
    from server.frontends.engine import Engine
    from server.frontends.remote import RemoteScheduler

    class Reaped:
        pid = 0

        def wait(self) -> int:
            return 0

    async def scenario():
        fake = _FakeScheduler()
        fake.release = asyncio.Event()
        engine = Engine(None, None, Metrics())  # type: ignore[arg-type]
        engine.scheduler = fake  # type: ignore[assignment]
        engine.stopping = True  # the front end's exit at the end is expected
        mine, theirs = socket.socketpair()
        fe = await engine.connect(0, Reaped(), mine)  # type: ignore[arg-type]
        counter = fe.channel._transport = _CountingTransport(fe.channel._transport)
        remote = RemoteScheduler(theirs, metrics=Metrics(), engine_alive=True)
        remote.start()
        items = [[[i, i + 1, i + 2]] * (1 + i % 3) for i in range(40)]
        tasks = [asyncio.create_task(remote.submit(it, request_id=f"r{i}", namespace=b"t%d" % (i % 2)))
                 for i, it in enumerate(items)]
        while len(fake.seen) < len(items):
            await asyncio.sleep(0.01)
        tasks[7].cancel()
        while "r7" not in fake.cancelled:
            await asyncio.sleep(0.01)
        fake.release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        remote.stop()
        while not fe.gone:
            await asyncio.sleep(0.01)
        return items, results, fake, counter.writes

    loop = asyncio.new_event_loop()
    try:
        items, results, fake, writes = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert isinstance(results[7], asyncio.CancelledError) and fake.cancelled == ["r7"]
    assert sorted(fake.seen) == sorted((f"r{i}", False, b"t%d" % (i % 2)) for i in range(40))
    for i, (it, res) in enumerate(zip(items, results)):
        if i == 7:
            continue
        assert [o.tolist() for o in res.outputs] == [[float(sum(x)), float(len(x))] for x in it]
        assert (res.queue_time_s, res.inference_time_s, res.compute_tokens) == (0.5, 0.25, len(it))
    assert writes < len(items) - 1  # the 39 results left in fewer writes than one each


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


def _wait_gone(pids: list[int], timeout: float = 120.0) -> None:
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

"""Load-test client against live HTTP servers: a small fake radixserve (FastAPI in a thread) and
the real `radixserve` on a fixture checkpoint when the server package is importable."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from loadtest import cli, client, compare, datasets, machine, report, workloads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_app(name: str = "", arrivals: list | None = None):
    """/rerank, /embed, /v1/embeddings, /metrics, /health with plausible answers and its own bookkeeping:
    per request it records the original/compact token counts it reports, so the test can check
    the client's /metrics deltas against an independent tally. `arrivals`, a list several fake
    servers may share: each answered request appends (name, its texts), in arrival order."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    reg = CollectorRegistry()
    ratio = Histogram("te_radix_mlp_compression_ratio", "r", buckets=(0.25, 0.5, 0.75, 1.0), registry=reg)
    tokens = Counter("radixserve_tokens", "t", ["kind"], registry=reg)
    app = FastAPI()
    app.state.log = []  # (route, original, compact) per answered request, in arrival order

    def account(route: str, texts: list[str]) -> None:
        orig = sum(len(t.split()) + 1 for t in texts)
        comp = len({w for t in texts for w in t.split()}) + 1  # "deduplicated" size
        ratio.observe(comp / orig)
        tokens.labels(kind="original").inc(orig)
        tokens.labels(kind="compact").inc(comp)
        app.state.log.append((route, orig, comp))
        if arrivals is not None:
            arrivals.append((name, tuple(texts)))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(reg).decode())

    @app.post("/rerank")
    async def rerank(req: Request):
        body = await req.json()
        if body["query"] == "overload":
            return JSONResponse({"error": "busy", "error_type": "overloaded"}, status_code=429)
        texts = body["texts"]
        account("/rerank", [body["query"] + " " + t for t in texts])
        scores = [1.0 / (1 + i) for i in range(len(texts))]
        return [{"index": i, "score": s} for i, s in enumerate(scores)]

    @app.post("/embed")
    async def embed(req: Request):
        body = await req.json()
        inputs = [body["inputs"]] if isinstance(body["inputs"], str) else body["inputs"]
        account("/embed", inputs)
        return [[0.0, 1.0] for _ in inputs]

    @app.post("/v1/embeddings")
    async def embeddings(req: Request):
        body = await req.json()
        account("/v1/embeddings", body["input"])
        data = [{"object": "embedding", "index": i, "embedding": [0.0, 1.0]} for i in range(len(body["input"]))]
        return {"object": "list", "data": data, "model": "fake", "usage": {"prompt_tokens": 1, "total_tokens": 1}}

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    app = _fake_app()
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    client.wait_healthy(url, timeout=600)
    yield url, app
    server.should_exit = True
    thread.join(timeout=10)


def _dataset() -> datasets.Dataset:
    syn = datasets.synthetic(5, seed=2).samples
    return datasets.Dataset("synthetic(seed=2)", syn[:2] + (datasets.Sample("overload", ("x", "y")),) + syn[2:])


def test_run_against_fake_server(fake_server):
    url, app = fake_server
    reqs = workloads.build_requests(_dataset(), "rerank")
    n, warmup = 14, 1
    start = len(app.state.log)
    res = client.run(reqs, client.RunConfig(url=url, concurrency=3, requests=n, warmup=warmup, progress=False))
    sent = [reqs[i % len(reqs)] for i in range(n)]  # the client sends indices 0..n-1, each once
    failing = [r for r in sent if r.body["query"] == "overload"]
    assert res.sent == n and dict(res.errors) == {"429": len(failing)}
    assert res.ok == n - len(failing) and len(res.latencies_s) == res.ok
    assert res.items_ok == sum(r.items for r in sent if r.body["query"] != "overload")
    assert all(0 < lat <= res.wall_s for lat in res.latencies_s)
    # Server-side deltas cover exactly the measured requests (the warm-up request is excluded).
    measured = app.state.log[start + warmup :]
    assert len(measured) == res.ok
    assert res.metrics.batches == res.ok
    assert res.metrics.tokens_original == sum(o for _, o, _ in measured)
    assert res.metrics.tokens_compact == sum(c for _, _, c in measured)
    assert res.metrics.mean_ratio == pytest.approx(sum(c / o for _, o, c in measured) / len(measured))


def _texts(req: workloads.Request) -> list[str]:
    body = req.body
    for key in ("texts", "input", "inputs"):
        if key in body:
            items = body[key] if isinstance(body[key], list) else [body[key]]
            return [(body["query"] + "\n" if "query" in body else "") + t for t in items]
    raise AssertionError(body)


@pytest.mark.parametrize("workload", workloads.WORKLOADS)
def test_the_warmup_shares_with_measured_requests_only_what_they_share_with_each_other(workload):
    """The CLI's warm-up (built from the marked data set): each warm-up text is the marker after a
    part every measured text of the workload may share (a template, an instruction, a prompt); no
    measured text holds the marker, so a prefix cache can answer nothing measured from the warm-up."""
    a = cli.build_parser().parse_args(["compare", "--target", "x=http://127.0.0.1:9", "--workload", workload,
                                       "--source", "synthetic", "--queries", "6", "--warmup", "3"])
    ds = cli._dataset(a)
    measured, warm = cli._requests(a, ds), cli._warmups(a, ds)
    assert len(warm) == 3
    mtexts = [t for r in measured for t in _texts(r)]
    assert not any(workloads.WARMUP_MARK in t for t in mtexts)
    for r in warm:
        for t in _texts(r):
            head = t[: t.index(workloads.WARMUP_MARK)]
            assert any(m.startswith(head) for m in mtexts), (workload, head[-80:])
            assert not any(m.startswith(t[: len(head) + len(workloads.WARMUP_MARK)]) for m in mtexts)


def test_warmup_continues_sends_no_warmup_request_twice():
    """With warmup_continues the measured run cycles over the requests after the warm-up's: the
    server sees the warm-up's requests once, first, and the measured ones from the rest of the list;
    the /metrics deltas count only the measured ones."""
    import uvicorn

    arrivals: list = []
    app = _fake_app("fake", arrivals)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        client.wait_healthy(url, timeout=600)
        reqs = [workloads.Request("/embed", {"inputs": [f"text {i}", f"more {i}"]}, 2) for i in range(6)]
        warmup, n = 2, 7  # 7 measured requests over the 4 after the warm-up: one pass and 3 repeats
        cfg = client.RunConfig(url=url, concurrency=2, requests=n, warmup=warmup, progress=False,
                               warmup_continues=True)
        res = client.run(reqs, cfg)
        texts = [t for _, t in arrivals]
        assert texts[:warmup] == [tuple(workloads.marked(r).body["inputs"]) for r in reqs[:warmup]]
        rest = reqs[warmup:]
        want = sorted(tuple(rest[i % len(rest)].body["inputs"]) for i in range(n))
        assert sorted(texts[warmup:]) == want
        assert res.ok == res.sent == n and res.distinct == len(rest)
        measured = app.state.log[warmup:]
        assert res.metrics.tokens_original == sum(o for _, o, _ in measured)
        # Without it the measured run starts over at the list's first request.
        arrivals.clear()
        client.run(reqs, client.RunConfig(url=url, concurrency=1, requests=3, warmup=warmup, progress=False))
        assert [t for _, t in arrivals] == [tuple(r.body["inputs"]) for r in
                                            [workloads.marked(x) for x in reqs[:warmup]] + reqs[:3]]
        with pytest.raises(ValueError, match="none is left"):
            client.run(reqs, client.RunConfig(url=url, requests=1, warmup=6, progress=False, warmup_continues=True))
        a = cli.build_parser().parse_args(["run", "--url", url, "--warmup", "3", "--warmup-continues"])
        ds = datasets.synthetic(2)
        assert cli._run_config(a, url, ds).warmup_continues and not cli._run_config(
            cli.build_parser().parse_args(["run", "--url", url]), url, ds).warmup_continues
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_duration_bound_and_connection_errors(fake_server):
    url, _ = fake_server
    reqs = workloads.build_requests(_dataset(), "embed", batch_size=8)
    t0 = time.perf_counter()
    res = client.run(reqs, client.RunConfig(url=url, concurrency=2, duration=0.5, warmup=0, progress=False))
    assert 0.5 <= time.perf_counter() - t0 < 10 and res.ok > 0 and not res.errors
    # a fake server answers at once: 0.5 s goes round this short list, and the report says so
    assert res.distinct == len(reqs) and res.sent > len(reqs)
    s = report.summarize(res, name="fast")
    assert s["passes"] == pytest.approx(res.sent / len(reqs))
    (line,) = report.repeat_warnings([s])
    assert line.startswith(f"fast: {res.sent} requests sent from a list of {len(reqs)}")
    one = client.run(reqs, client.RunConfig(url=url, concurrency=2, warmup=0, progress=False))
    assert one.sent == len(reqs) and report.repeat_warnings([report.summarize(one, name="once")]) == []
    dead = f"http://127.0.0.1:{_free_port()}"
    res = client.run(reqs, client.RunConfig(url=dead, concurrency=2, requests=4, warmup=0, progress=False))
    assert res.ok == 0 and dict(res.errors) == {"connection": 4} and res.metrics.mean_ratio is None
    with pytest.raises(ValueError):
        client.check_url("127.0.0.1:8080")


def test_cli_run_writes_reports(fake_server, tmp_path):
    url, _ = fake_server
    data = tmp_path / "d.jsonl"
    datasets.write_jsonl(datasets.synthetic(6, seed=5), data)
    out = tmp_path / "out"
    rc = cli.main(["run", "--url", url, "--workload", "embed-template", "--source", "file", "--dataset-path",
                   str(data), "--batch-size", "16", "--concurrency", "2", "--no-progress", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "report.json").read_text())
    run = doc["runs"][0]
    n_items = sum(len(s.passages) for s in datasets.synthetic(6, seed=5).samples)
    assert run["source"] == "file:d.jsonl" and run["workload"] == "embed-template"
    assert run["requests_ok"] == -(-n_items // 16) and run["error_count"] == 0
    assert run["items_per_s"] == pytest.approx(n_items / run["wall_s"])
    assert 0 < run["server"]["mean_compression_ratio"] < 1
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "embed-template" in (out / "report.md").read_text()
    # the machine it ran on: this one, with the load average at the start and at the end
    assert run["machine"]["simd"] == machine.current()["simd"] and len(run["machine"]["load_end"]) == 3
    assert f"- machine: {machine.line(run['machine'])}" in (out / "report.md").read_text()


# ---------------------------------------------------------------- the real server


def _have_server() -> bool:
    try:
        import server.app  # noqa: F401
        import server.cli  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _have_server(), reason="server package not importable yet")
def test_compare_real_radixserve(tiny_reranker_dir, tmp_path):
    """Short real run: compare starts radixserve (radix always on) on the tiny reranker fixture,
    replays rerank requests, stops it, and reports. The server's token counter must equal the
    tokens of exactly the measured requests, counted here with the reranker template."""
    from tokenizers import Tokenizer

    from models.text import prompts
    ds = datasets.synthetic(4, seed=0)
    reqs = workloads.build_requests(ds, "rerank")
    n = 6
    targets = [compare.parse_server("compact: --radix-mlp-threshold 1 --max-batch-tokens 4096")]
    cfg = client.RunConfig(url="http://127.0.0.1", concurrency=2, requests=n, warmup=1, progress=False)
    [(t, res)] = compare.run_targets(targets, reqs, cfg, model_id=str(tiny_reranker_dir), log_dir=tmp_path,
                                     startup_timeout=600)
    log = (tmp_path / "server-compact.log").read_text()
    assert res.ok == n and not res.errors, (res.errors, log[-2000:])
    template = prompts.RerankTemplate(Tokenizer.from_file(str(Path(tiny_reranker_dir) / "tokenizer.json")))
    sent = [reqs[i % len(reqs)] for i in range(n)]
    want = sum(len(ids) for r in sent for ids in template.encode(r.body["query"], r.body["texts"],
                                                                max_length=32768, truncate=True))
    m = res.metrics
    assert m.tokens_original == want
    # Passages of one query share the template prefix + query: the trie must shrink the batch.
    assert m.tokens_compact < m.tokens_original and 0 < m.mean_ratio < 1
    s = report.summarize(res, name=t.name, meta={"workload": "rerank", "source": ds.source})
    assert s["tokens_per_s"] == pytest.approx(want / res.wall_s)

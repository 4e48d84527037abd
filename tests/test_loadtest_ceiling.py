"""The load client is never the bottleneck unnoticed: base64 answers where the route has them,
a check that a base64 answer really is one, the client's own CPU share, and its ceiling measured
against the zero-cost responder."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from loadtest import client, datasets, report, responder, workloads


def _reqs(encoding: str, n: int = 6):
    return workloads.build_requests(datasets.synthetic(n, seed=3), "embed-template", batch_size=8, encoding=encoding)


def test_base64_is_asked_of_embeddings_only():
    reqs = _reqs("base64")
    assert reqs and all(r.body["encoding_format"] == "base64" for r in reqs)
    assert all("encoding_format" not in r.body for r in _reqs("float"))
    rerank = workloads.build_requests(datasets.synthetic(3, seed=3), "rerank", encoding="base64")
    assert all("encoding_format" not in r.body for r in rerank)
    with pytest.raises(ValueError):
        workloads.build_requests(datasets.synthetic(3, seed=3), "embed", encoding="hex")


def test_a_float_answer_to_a_base64_request_is_a_bad_response():
    req = _reqs("base64")[0]
    n = req.items
    floats = httpx.Response(200, json={"data": [{"embedding": [0.5, 0.25]} for _ in range(n)]})
    b64 = httpx.Response(200, json={"data": [{"embedding": "AAAAPw=="} for _ in range(n)]})
    short = httpx.Response(200, json={"data": [{"embedding": "AAAAPw=="} for _ in range(n - 1)]})
    assert client._answer_ok(b64, req) and not client._answer_ok(floats, req) and not client._answer_ok(short, req)


def test_the_responder_answers_what_was_asked():
    r = responder.Responder(dims=4)
    for req in (_reqs("base64")[0], _reqs("float")[0]):
        status, body = r.answer("POST", req.route, httpx.Request("POST", "http://x", json=req.body).read())
        assert status == 200 and client._answer_ok(httpx.Response(200, content=body), req)
    status, body = r.answer("POST", "/v1/embeddings", b'{"input": ["a"], "encoding_format": "base64"}')
    vec = np.frombuffer(base64.b64decode(httpx.Response(200, content=body).json()["data"][0]["embedding"]), "<f4")
    assert vec.tolist() == [0.5] * 4  # the little-endian float32 bytes the OpenAI SDK decodes
    assert r.answer("POST", "/rerank", b"not json")[0] == 422 and r.answer("GET", "/health", b"")[0] == 200


def test_the_client_ceiling_run_sends_each_request_once_and_reports_its_cpu():
    reqs = _reqs("base64", n=12)
    cfg = client.RunConfig(url="http://unused", concurrency=4, requests=len(reqs) - 1, warmup=1,
                           warmup_continues=True, progress=False)
    res = responder.measure_ceiling(reqs, cfg, dims=16)
    assert res.ok == res.sent == len(reqs) - 1 and not res.errors
    assert res.client_cpu_s > 0
    s = report.summarize(res, name="ceiling")
    assert s["client_cpu_share"] == pytest.approx(res.client_cpu_s / res.wall_s)
    assert "Load client CPU" in report.markdown([s])


def test_headroom_says_when_the_client_may_have_set_the_pace():
    assert responder.headroom(100.0, 1000.0) == {"headroom": 10.0, "clean": True}
    assert responder.headroom(600.0, 1000.0)["clean"] is False
    assert responder.headroom(None, 1000.0)["headroom"] is None

"""Every bad input gets its documented status and its route's error body; none is a 5xx.

Also: the API key (401), the payload limit (413, from Content-Length and from a chunked body),
and FastAPI's own errors (404/405) in our formats.
"""
from __future__ import annotations

import httpx
import pytest

from server.app import create_app
from server.config import ServerConfig
from server.testing import ServerThread, cached_runner

LONG = "word " * 200  # ~200 tokens


@pytest.fixture(scope="module")
def srv(tiny_embedding_dir):
    runner = cached_runner(str(tiny_embedding_dir))
    config = ServerConfig(
        model_id=str(tiny_embedding_dir), max_client_batch_size=4, max_input_length=64, auto_truncate=False,
        payload_limit=4096,
    )
    with ServerThread(create_app(config, runner=runner)) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(tiny_embedding_dir):
    runner = cached_runner(str(tiny_embedding_dir))
    config = ServerConfig(model_id=str(tiny_embedding_dir), api_key="s3cret")
    with ServerThread(create_app(config, runner=runner)) as s:
        yield s


def assert_error(r: httpx.Response, status: int, *, openai: bool) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    if openai:
        err = body["error"]
        assert set(err) >= {"message", "type", "code"} and err["message"]
    else:
        assert set(body) == {"error", "error_type"} and body["error"] and body["error_type"]


JSON_CASES = [
    # TEI /embed
    ("/embed", {"inputs": ""}, 400),
    ("/embed", {"inputs": []}, 400),
    ("/embed", {"inputs": ["ok", ""]}, 400),
    ("/embed", {"inputs": 5}, 422),
    ("/embed", {"inputs": [1, 2]}, 422),
    ("/embed", {"inputs": None}, 422),
    ("/embed", {}, 422),
    ("/embed", ["not", "an", "object"], 422),
    ("/embed", {"inputs": ["a"] * 5}, 422),
    ("/embed", {"inputs": LONG}, 422),
    ("/embed", {"inputs": LONG, "truncate": False}, 422),
    ("/embed", {"inputs": "x", "truncate": "maybe"}, 422),
    ("/embed", {"inputs": "x", "dimensions": 0}, 422),
    ("/embed", {"inputs": "x", "dimensions": -3}, 422),
    ("/embed", {"inputs": "x", "dimensions": 65}, 422),
    ("/embed", {"inputs": "x", "dimensions": 10**30}, 422),
    ("/embed", {"inputs": "x", "dimensions": 2.5}, 422),
    ("/embed", {"inputs": "x", "prompt_name": "nope"}, 422),
    ("/embed", {"inputs": "x", "truncation_direction": "up"}, 422),
    ("/embed", {"inputs": "x", "normalize": "yes please"}, 422),
    # wrong model type
    ("/rerank", {"query": "q", "texts": ["a"]}, 400),
    ("/v1/rerank", {"query": "q", "documents": ["a"]}, 400),
    # OpenAI
    ("/v1/embeddings", {"input": ""}, 400),
    ("/v1/embeddings", {"input": []}, 400),
    ("/v1/embeddings", {"input": [[]]}, 400),
    ("/v1/embeddings", {"input": [1, -1]}, 422),
    ("/v1/embeddings", {"input": [151669]}, 422),
    ("/v1/embeddings", {"input": [[1, 2], [10**12]]}, 422),
    ("/v1/embeddings", {"input": [3, 10**6, 4]}, 422),  # out of range in the middle
    ("/v1/embeddings", {"input": [1.5, 2]}, 422),
    ("/v1/embeddings", {"input": ["a", 1]}, 422),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 422),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, 422),
    ("/v1/embeddings", {"input": ["a"] * 5}, 422),
    ("/v1/embeddings", {"input": list(range(1, 100))}, 422),
    ("/embeddings", {"input": 3}, 422),
    # /tokenize
    ("/tokenize", {"inputs": ""}, 400),
    ("/tokenize", {"inputs": 3}, 422),
    ("/tokenize", {"inputs": "x", "prompt_name": "nope"}, 422),
]


@pytest.mark.parametrize("path,body,status", JSON_CASES)
def test_bad_json_inputs(srv, path, body, status):
    r = httpx.post(srv.url + path, json=body, timeout=30)
    assert_error(r, status, openai=path.startswith("/v1/") or path == "/embeddings")


RAW_CASES = [
    ("/embed", b'{"inputs": "x", "dimensions": 1e309}', 422),  # inf
    ("/embed", b'{"inputs": "x", "dimensions": NaN}', 422),
    ("/embed", b'{"inputs": ', 422),
    ("/embed", b"\xff\xfe\x00garbage", 422),
    ("/embed", b'{"inputs": "\xff\xfe"}', 422),  # not UTF-8
    ("/v1/embeddings", b'{"input": "x", "dimensions": 1e309}', 422),
    ("/v1/embeddings", b"{{{", 422),
    ("/v1/rerank", b'{"query": "q", "documents": ["a"], "top_n": -1}', 400),  # the wrong model is judged first
    ("/embed", b"x" * 5000, 413),
    ("/v1/embeddings", b"x" * 5000, 413),
]


@pytest.mark.parametrize("path,content,status", RAW_CASES)
def test_bad_raw_bodies(srv, path, content, status):
    r = httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert_error(r, status, openai=path.startswith("/v1/"))


def test_chunked_oversize_body(srv):
    def chunks():
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(srv.url + "/embed", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, openai=False)


def test_truncate_default_and_explicit(srv):
    ok = httpx.post(srv.url + "/embed", json={"inputs": LONG, "truncate": True})
    assert ok.status_code == 200 and int(ok.headers["x-compute-tokens"]) == 64


def test_unknown_route_and_method(srv):
    assert_error(httpx.get(srv.url + "/nope"), 404, openai=False)
    assert_error(httpx.get(srv.url + "/embed"), 405, openai=False)


def test_api_key(keyed):
    import openai

    url = keyed.url
    assert_error(httpx.post(url + "/embed", json={"inputs": "x"}), 401, openai=False)
    bad = {"Authorization": "Bearer wrong"}
    assert_error(httpx.post(url + "/embed", json={"inputs": "x"}, headers=bad), 401, openai=False)
    assert_error(httpx.post(url + "/v1/embeddings", json={"input": "x"}, headers=bad), 401, openai=True)
    good = {"Authorization": "Bearer s3cret"}
    assert httpx.post(url + "/embed", json={"inputs": "x"}, headers=good).status_code == 200
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/info").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).embeddings.create(model="m", input="x")
    ok = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0).embeddings.create(model="m", input="x")
    assert len(ok.data) == 1

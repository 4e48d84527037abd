"""Every bad input gets its documented status and its route's error body; none is a 5xx.

Also: the API key (401), the payload limit (413, from Content-Length and from a chunked body),
and FastAPI's own errors (404/405) in our formats.
"""
from __future__ import annotations

import httpx
import pytest

from server.app import create_app
from server.config import ServerConfig
from tests.serving import ServerThread, cached_runner

LONG = "word " * 200  # ~200 tokens


@pytest.fixture(scope="module")
def srv(tiny_embedding_dir):
    runner = cached_runner(str(tiny_embedding_dir))
    config = ServerConfig(
        model_id=str(tiny_embedding_dir), max_client_batch_size=4, max_input_length=64, auto_truncate=False,
        payload_limit=4096, allow_token_ids=True,  # the id checks below are the vocabulary's
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
    ("/v1/embeddings", {"input": "x", "dimensions": -1}, 422),
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
    name = httpx.get(url + "/info").json()["served_model_name"]
    ok = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0).embeddings.create(model=name, input="x")
    assert len(ok.data) == 1


# -- 5xx bodies name a request id, never the exception -------------------------------------------
def _failing_runner(runner, message: str):
    import dataclasses

    copy = dataclasses.replace(runner)

    def run(batch):
        raise RuntimeError(message)

    copy.run = run
    return copy


def test_model_failure_is_generic_500_with_request_id(tiny_embedding_dir, caplog):
    runner = _failing_runner(cached_runner(str(tiny_embedding_dir)), "secret tensor detail 0xdeadbeef")
    with ServerThread(create_app(ServerConfig(model_id=str(tiny_embedding_dir)), runner=runner)) as s:
        with caplog.at_level("ERROR"):
            tei = httpx.post(s.url + "/embed", json={"inputs": "x"}, headers={"x-request-id": "req-7"}, timeout=60)
            oai = httpx.post(s.url + "/v1/embeddings", json={"input": "x"}, timeout=60)
    assert tei.status_code == 500 and tei.json() == {"error": "internal error; request id req-7", "error_type": "Backend"}
    assert tei.headers["x-request-id"] == "req-7"
    rid = oai.headers["x-request-id"]
    assert oai.status_code == 500 and oai.json()["error"]["message"] == f"internal error; request id {rid}"
    assert "deadbeef" not in tei.text + oai.text
    for want in ("req-7", rid):
        lines = [r.getMessage() for r in caplog.records if want in r.getMessage()]
        assert any("deadbeef" in line for line in lines), (want, lines)


class _DeadScheduler:
    """A scheduler whose worker died with an exception between the alive check and submit
    (server.service.contract.ServedScheduler's fields; no metrics: the app makes its own)."""

    alive = True
    queue_size = 0
    metrics = None

    def start(self) -> None: ...

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None: ...

    async def submit(self, items, **kw):
        from scheduler import WorkerDead

        raise WorkerDead("the model worker died: RuntimeError: secret worker detail")


def test_dead_worker_503_hides_the_exception_and_says_retry_after(tiny_embedding_dir, caplog):
    runner = cached_runner(str(tiny_embedding_dir))
    app = create_app(ServerConfig(model_id=str(tiny_embedding_dir)), runner=runner, scheduler=_DeadScheduler())
    with ServerThread(app) as s, caplog.at_level("ERROR"):
        r = httpx.post(s.url + "/embed", json={"inputs": "x"})
        rid = r.headers["x-request-id"]
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert "secret" not in r.text and rid in r.json()["error"] and r.json()["error_type"] == "Unhealthy"
        assert any(rid in rec.getMessage() and "secret worker detail" in rec.getMessage() for rec in caplog.records)
        s.server.config.app.state.service.scheduler.alive = False
        down = httpx.post(s.url + "/v1/embeddings", json={"input": "x"})
        assert down.status_code == 503 and down.headers["retry-after"] == "5"


# -- /tokenize: admitted like the other routes, answer bounded ---------------------------------------
@pytest.fixture(scope="module")
def small(tiny_embedding_dir):
    runner = cached_runner(str(tiny_embedding_dir))
    config = ServerConfig(model_id=str(tiny_embedding_dir), max_concurrent_requests=4, max_client_batch_size=4,
                          max_batch_tokens=64)
    with ServerThread(create_app(config, runner=runner)) as s:
        yield s


def test_tokenize_takes_permits(small):
    permits = small.server.config.app.state.service.permits
    assert permits.try_acquire(1)  # another request holds one of the 4 permits
    try:
        r = httpx.post(small.url + "/tokenize", json={"inputs": ["a"] * 4})  # 4 inputs > 3 left
    finally:
        permits.release(1)
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error_type"] == "Overloaded"
    ok = httpx.post(small.url + "/tokenize", json={"inputs": ["a"] * 4})
    assert ok.status_code == 200 and len(ok.json()) == 4
    assert small.server.config.app.state.service.permits.in_use == 0


def test_tokenize_output_is_capped(small):
    tok = small.server.config.app.state.service.runner.tokenizer
    text = "word " * 30  # ~31 tokens with the special token
    n = len(tok.encode(text).ids)
    assert n * 2 <= 64 < n * 3
    assert httpx.post(small.url + "/tokenize", json={"inputs": [text] * 2}).status_code == 200
    r = httpx.post(small.url + "/tokenize", json={"inputs": [text] * 3})
    assert r.status_code == 422 and f"{3 * n} tokens" in r.json()["error"] and "64" in r.json()["error"]


def test_tokenize_answer_is_bounded_by_the_cap(small):
    """A 1.8 MB body answers a short 422 (it used to answer 42 MB of token objects)."""
    r = httpx.post(small.url + "/tokenize", json={"inputs": ["ab " * 150_000] * 4}, timeout=60)
    assert r.status_code == 422 and len(r.content) < 1000
    tok = small.server.config.app.state.service.runner.tokenizer
    text = next(t for t in ("ab " * k for k in range(80, 0, -1)) if len(tok.encode(t).ids) <= 64)
    full = httpx.post(small.url + "/tokenize", json={"inputs": [text]})  # at the cap
    n = len(tok.encode(text).ids)
    assert n >= 60 and full.status_code == 200 and len(full.json()[0]) == n and len(full.content) < n * 100


def test_retry_after_on_429(small):
    import asyncio

    async def main():
        async with httpx.AsyncClient(base_url=small.url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/embed", json={"inputs": ["t"] * 4}) for _ in range(8)))

    codes = {r.status_code: r for r in asyncio.run(main())}
    assert set(codes) <= {200, 429}
    if 429 in codes:
        assert codes[429].headers["retry-after"] == "1"


UTF_CASES = [
    ('{"inputs": "é"}'.encode("utf-16"), "UTF-16"),  # with a BOM
    ('{"inputs": "x"}'.encode("utf-16-le"), "UTF-16"),  # without
    ('{"inputs": "é"}'.encode("latin-1"), "not valid UTF-8"),
]


@pytest.mark.parametrize("content,fragment", UTF_CASES)
def test_non_utf8_body_is_422(srv, content, fragment):
    r = httpx.post(srv.url + "/embed", content=content, headers={"content-type": "application/json"})
    assert_error(r, 422, openai=False)
    assert fragment in r.json()["error"]


def test_non_json_content_type_is_415(srv):
    r = httpx.post(srv.url + "/embed", content=b'{"inputs": "x"}', headers={"content-type": "text/plain"})
    assert_error(r, 415, openai=False)
    r = httpx.post(srv.url + "/v1/embeddings", data={"input": "x"})
    assert_error(r, 415, openai=True)

"""The front door (server.http.front_door.FrontDoor) over real HTTP: request ids, the API key, content
types, the payload limit and the body read deadline, on a bare app and on the full server."""
from __future__ import annotations

import re
import socket
import time

import httpx
import pytest
from fastapi import FastAPI, Request

from server.http.front_door import FrontDoor, bearer_matches, json_content_type
from server.app import create_app
from server.config import ServerConfig
from server.http.errors import install_handlers
from tests.serving import ServerThread, cached_runner, http_stacks

KEY = "sëcret-ключ"  # non-ASCII: sent as UTF-8 bytes


def bare_app(**guard) -> FastAPI:
    app = FastAPI()
    install_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"n": len(await request.body()), "rid": request.state.request_id}

    @app.post("/v1/echo")
    async def echo_v1(request: Request) -> dict:
        return {"n": len(await request.body())}

    @app.get("/open")
    async def open_route() -> dict:
        return {"ok": True}

    @app.post("/boom")
    async def boom() -> dict:
        raise RuntimeError("secret internal detail")

    app.add_middleware(FrontDoor, **{"payload_limit": 1000, "api_key": None, **guard})
    return app


@pytest.fixture(scope="module", params=http_stacks())
def plain(request):
    """The bare app under the CLI's listener on each HTTP stack (request ids, 408, 413, 415)."""
    with ServerThread(bare_app(body_timeout_s=0.5), stack=request.param) as s:
        yield s


@pytest.fixture(scope="module")
def keyed_bare():
    with ServerThread(bare_app(api_key=KEY)) as s:
        yield s


HEX16 = re.compile(r"[0-9a-f]{16}")


def test_request_id_on_every_response(plain):
    for r in (
        httpx.post(plain.url + "/echo", json={}),
        httpx.get(plain.url + "/open"),
        httpx.get(plain.url + "/missing"),
        httpx.post(plain.url + "/echo", content=b"x" * 2000),
        httpx.post(plain.url + "/echo", content=b"x", headers={"content-type": "text/plain"}),
    ):
        assert HEX16.fullmatch(r.headers["x-request-id"]), (r.status_code, r.headers)
    ok = httpx.post(plain.url + "/echo", json={})
    assert ok.json()["rid"] == ok.headers["x-request-id"]
    two = {httpx.get(plain.url + "/open").headers["x-request-id"] for _ in range(3)}
    assert len(two) == 3


@pytest.mark.parametrize("sent,kept", [
    ("abc-123_X.y", True), ("a" * 64, True), ("a" * 65, False), ("has space", False), ("", False),
    ("semi;colon", False), ("ünï", False),
])
def test_client_request_id_reused_only_when_sane(plain, sent, kept):
    r = httpx.post(plain.url + "/echo", json={}, headers={"x-request-id": sent.encode()})
    rid = r.headers["x-request-id"]
    assert (rid == sent) if kept else HEX16.fullmatch(rid)
    assert r.json()["rid"] == rid


def test_unhandled_error_is_generic_500_with_the_id(plain, caplog):
    with caplog.at_level("ERROR", logger="radixserve.server"):
        r = httpx.post(plain.url + "/boom", json={}, headers={"x-request-id": "trace-42"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "trace-42"
    assert r.json() == {"error": "internal error; request id trace-42", "error_type": "Backend"}
    logged = [rec for rec in caplog.records if "trace-42" in rec.getMessage()]
    assert logged and "secret internal detail" in str(logged[0].exc_info[1])


@pytest.mark.parametrize("content_type,status", [
    ("application/json", 200),
    ("application/json; charset=utf-8", 200),
    ("Application/JSON;charset=\"UTF-8\"", 200),
    ("application/vnd.api+json", 200),
    (None, 200),  # no header: the body is validated as JSON
    ("application/x-www-form-urlencoded", 415),  # curl -d
    ("text/plain", 415),
    ("multipart/form-data; boundary=x", 415),
    ("application/xml", 415),
    ("application/json; charset=utf-16", 415),
    ("", 415),
])
def test_content_type(plain, content_type, status):
    headers = {} if content_type is None else {"content-type": content_type}
    for path, openai in (("/echo", False), ("/v1/echo", True)):
        r = httpx.post(plain.url + path, content=b"{}", headers=headers)
        assert r.status_code == status, (content_type, r.text)
        if status == 415:
            body = r.json()
            message = body["error"]["message"] if openai else body["error"]
            assert "application/json" in message or "UTF-8" in message
            if not openai:
                assert body["error_type"] == "UnsupportedMediaType"


@pytest.mark.parametrize("encoding, status", [
    ("gzip", 415), ("deflate", 415), ("br", 415), ("zstd", 415), ("gzip, identity", 415), ("x-anything", 415),
    ("identity", 200), ("Identity", 200),
])
def test_content_encoding_is_not_decoded_but_refused(plain, encoding, status):
    import gzip

    body = gzip.compress(b'{"inputs": "hello"}')
    for path, openai in (("/echo", False), ("/v1/echo", True)):
        r = httpx.post(plain.url + path, content=body if status == 415 else b"{}",
                       headers={"content-type": "application/json", "content-encoding": encoding})
        assert r.status_code == status, (encoding, r.text)
        if status == 415:
            message = r.json()["error"]["message"] if openai else r.json()["error"]
            assert "Content-Encoding" in message and "uncompressed" in message


def test_content_encoding_counts_every_header_line(plain):
    """gzip then identity on two lines is still gzip: judged over every line, not the last."""
    import gzip

    headers = [("content-type", "application/json"), ("content-encoding", "gzip"), ("content-encoding", "identity")]
    r = httpx.post(plain.url + "/echo", content=gzip.compress(b"{}"), headers=headers)
    assert r.status_code == 415 and "Content-Encoding" in r.json()["error"], r.text


def test_gzip_body_on_the_full_server_is_415_not_422(keyed_server):
    import gzip

    good = {"authorization": b"Bearer " + KEY.encode(), "content-type": "application/json",
            "content-encoding": "gzip"}
    r = httpx.post(keyed_server.url + "/embed", content=gzip.compress(b'{"inputs": "x"}'), headers=good)
    assert r.status_code == 415 and r.json()["error_type"] == "UnsupportedMediaType", r.text


def test_form_content_type_message_names_curl(plain):
    r = httpx.post(plain.url + "/echo", data={"inputs": "x"})
    assert r.status_code == 415 and "curl" in r.json()["error"]


def _raw_post(url: str, head_extra: str, body_parts: list[tuple[float, bytes]], *, read_timeout: float = 10.0):
    """POST over a raw socket, sending ``body_parts`` after their delays; returns (status, elapsed)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head_extra}\r\n".encode())
        t0 = time.monotonic()
        for delay, part in body_parts:
            time.sleep(delay)
            try:
                sock.sendall(part)
            except OSError:
                break
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return int(data.split(b" ")[1]), time.monotonic() - t0, data


def test_trickled_body_is_cut_off_with_408(plain):
    # Content-Length 100 but only a byte every 0.2 s: one deadline for the whole body (0.5 s here).
    # A per-read timeout would never fire on this trickle, so the 408 alone shows the whole-body
    # deadline (no wall-time bound: a busy machine stretches every figure).
    status, _, raw = _raw_post(plain.url, "Content-Length: 100\r\n", [(0.2, b" ")] * 10)
    assert status == 408
    assert b"did not arrive within" in raw and b"x-request-id" in raw.lower()
    # a body that stalls entirely after the headers
    status, elapsed, _ = _raw_post(plain.url, "Content-Length: 10\r\n", [])
    assert status == 408
    # a prompt body on the same server is untouched
    assert _raw_post(plain.url, "Content-Length: 2\r\n", [(0.0, b"{}")])[0] == 200


def test_payload_limit_still_applies(plain):
    r = httpx.post(plain.url + "/echo", content=b" " * 1001, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error_type"] == "PayloadTooLarge"

    def chunks():
        for _ in range(5):
            yield b" " * 300

    r = httpx.post(plain.url + "/echo", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_bearer_matching_unit():
    import hashlib

    digest = hashlib.sha256(KEY.encode()).digest()
    assert bearer_matches(b"Bearer " + KEY.encode(), digest)
    assert bearer_matches(b"bearer   " + KEY.encode() + b" ", digest)
    assert not bearer_matches(KEY.encode("utf-8").decode("latin-1").encode("utf-8"), digest)
    for bad in (None, b"", b"Bearer", b"Bearer ", b"Basic " + KEY.encode(), KEY.encode(), b"Bearer wrong",
                b"Bearer " + KEY.encode()[:-1], b"Token " + KEY.encode()):
        assert not bearer_matches(bad, digest), bad
    assert json_content_type(b"application/problem+json") is None
    assert json_content_type(b"text/json") is not None


def test_api_key_as_utf8_bytes(keyed_bare):
    url = keyed_bare.url
    good = {"authorization": b"Bearer " + KEY.encode("utf-8")}
    assert httpx.post(url + "/echo", json={}, headers=good).status_code == 200
    for headers in ({}, {"authorization": "Bearer"}, {"authorization": "Basic abc"},
                    {"authorization": b"Bearer " + KEY.encode("utf-8")[:-1]}, {"authorization": KEY.encode()}):
        r = httpx.post(url + "/echo", json={}, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
        assert r.json()["error_type"] == "Unauthorized" and "x-request-id" in r.headers
    assert httpx.post(url + "/v1/echo", json={}).json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/open").status_code == 200  # GET routes stay open


@pytest.fixture(scope="module")
def keyed_server(tiny_embedding_dir):
    runner = cached_runner(str(tiny_embedding_dir))
    app = create_app(ServerConfig(model_id=str(tiny_embedding_dir), api_key=KEY), runner=runner)

    @app.post("/added-later")  # a route another module adds: protected without being listed anywhere
    async def added_later() -> dict:
        return {"ok": True}

    with ServerThread(app) as s:
        yield s


def post_paths(routes) -> set[str]:
    """Every POST path of a route list, through included routers."""
    out = set()
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            out |= post_paths(inner.routes)
        elif "POST" in (getattr(route, "methods", None) or ()):
            out.add(route.path)
    return out


def test_key_covers_every_post_route(keyed_server):
    url = keyed_server.url
    app = keyed_server.server.config.app
    posts = sorted(post_paths(app.routes))
    assert {"/embed", "/v1/embeddings", "/embeddings", "/rerank", "/v1/rerank", "/tokenize", "/added-later"} <= set(posts)
    for path in posts:
        r = httpx.post(url + path, json={"inputs": "x", "input": "x"})
        assert r.status_code == 401, path
    good = {"authorization": b"Bearer " + KEY.encode()}
    assert httpx.post(url + "/added-later", headers=good, json={}).json() == {"ok": True}
    assert httpx.post(url + "/embed", headers=good, json={"inputs": "x"}).status_code == 200
    for path in ("/info", "/health", "/metrics", "/docs", "/openapi.json"):
        assert httpx.get(url + path).status_code == 200, path

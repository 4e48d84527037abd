"""The express lane (server/http/express.py) answers exactly as FastAPI's router would.

Two servers on the same checkpoint (a runner each: their prefix caches fill alike), one with the
lane and one whose lane passes every request on to the router, get the same battery of requests: valid ones, each kind of refusal the front
door and the routes give, HEAD, wrong methods and unknown paths. Status, body and headers must be
equal (less the request id and the per-request timings). The table itself keeps the router's
first-match order.
"""
from __future__ import annotations

import json

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request, Response

import models
import server.app
from server.app import create_app
from server.config import ServerConfig
from server.http.express import eligible, express_routes
from tests.serving import ServerThread, cached_runner

VARYING = {"x-request-id", "date", "x-total-time", "x-queue-time", "x-inference-time", "x-tokenization-time",
           "x-compute-time"}
KEY = {"Authorization": "Bearer k3y"}
Q = "Instruct: Given a web search query, retrieve relevant passages\nQuery: what is the capital of france"

CASES = [
    ("GET", "/health", {}, None),
    ("HEAD", "/health", {}, None),
    ("GET", "/ping", {}, None),
    ("POST", "/v1/embeddings", KEY, {"input": Q}),
    ("POST", "/v1/embeddings", KEY, {"input": [Q, "second"], "model": "tiny", "encoding_format": "base64"}),
    ("POST", "/v1/embeddings", {}, {"input": Q}),  # no key: 401
    ("POST", "/v1/embeddings", KEY, {"input": Q, "model": "someone-else"}),  # 404 model_not_found
    ("POST", "/v1/embeddings", KEY, {"input": ""}),  # 400
    ("POST", "/v1/embeddings", KEY, {"inputs": Q}),  # 422
    ("POST", "/v1/embeddings", KEY, b"{not json"),  # 422
    ("POST", "/v1/embeddings", {**KEY, "Content-Type": "text/plain"}, b"{}"),  # 415
    ("POST", "/embeddings", KEY, {"input": Q}),
    ("POST", "/embed", KEY, {"inputs": [Q, Q[:20]], "normalize": False}),
    ("POST", "/embed", KEY, {"inputs": Q, "truncate": "maybe"}),
    ("POST", "/rerank", KEY, {"query": "q", "texts": ["a"]}),  # an embedding model: 400
    ("POST", "/v2/embed", KEY, {"texts": [Q], "input_type": "search_query", "embedding_types": ["float"]}),
    ("GET", "/v1/embeddings", KEY, None),  # 405
    ("POST", "/health", KEY, None),  # 405
    ("GET", "/nowhere", KEY, None),  # 404
    ("POST", "/embed/", KEY, {"inputs": Q}),  # trailing slash: the router's answer
    ("GET", "/v1/models", KEY, None),  # not in the lane: a dict answer
    ("GET", "/docs", {}, None),
]


class Bypass:
    """The lane's place in the middleware, passing every request on."""

    def __init__(self, app, **_) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def pair(tiny_embedding_dir):
    # NOTE: a runner each: they hold prefix caches, which the same requests fill alike
    runners = [models.load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32") for _ in range(2)]

    def config() -> ServerConfig:
        return ServerConfig(model_id=str(tiny_embedding_dir), api_key="k3y", served_model_name="tiny")

    with_lane = create_app(config(), runner=runners[0])
    real = server.app.ExpressLane
    server.app.ExpressLane = Bypass  # type: ignore[assignment,misc]
    try:
        without = create_app(config(), runner=runners[1])
    finally:
        server.app.ExpressLane = real  # type: ignore[assignment,misc]
    with ServerThread(with_lane) as a, ServerThread(without) as b:
        yield a, b


def answer(url: str, method: str, headers: dict, body) -> tuple[int, dict, bytes]:
    kwargs: dict = {"headers": headers}
    if isinstance(body, bytes):
        kwargs["content"] = body
        kwargs["headers"] = {"Content-Type": "application/json", **headers}
    elif body is not None:
        kwargs["json"] = body
    r = httpx.request(method, url, timeout=600, follow_redirects=False, **kwargs)
    port = url.split(":")[2].split("/")[0]
    kept = {k: v.replace(port, "PORT") for k, v in r.headers.items() if k not in VARYING}
    return r.status_code, kept, r.content


@pytest.mark.parametrize("method,path,headers,body", CASES, ids=[f"{m} {p} {i}" for i, (m, p, _, _) in
                                                                enumerate(CASES)])
def test_the_lane_answers_as_the_router(pair, method, path, headers, body):
    a, b = pair
    lane, router = answer(a.url + path, method, headers, body), answer(b.url + path, method, headers, body)
    assert lane[0] == router[0]
    assert lane[1] == router[1]
    if path == "/v2/embed" and lane[0] == 200:  # Cohere's answer id is fresh per answer
        assert {**json.loads(lane[2]), "id": ""} == {**json.loads(router[2]), "id": ""}
    elif path == "/v1/models":  # `created` is each server's start second: the two may straddle one
        def unstamped(body: bytes) -> dict:
            data = json.loads(body)
            return {**data, "data": [{**m, "created": 0} for m in data["data"]]}
        assert unstamped(lane[2]) == unstamped(router[2])
    else:
        assert lane[2] == router[2]


def test_the_hot_routes_are_in_the_lane(pair, tiny_embedding_dir):
    app = create_app(ServerConfig(model_id=str(tiny_embedding_dir)), runner=cached_runner(str(tiny_embedding_dir)))
    table = express_routes(app.router.routes)
    for key in [("GET", "/health"), ("POST", "/v1/embeddings"), ("POST", "/embed"), ("POST", "/rerank"),
                ("POST", "/v1/rerank"), ("POST", "/v2/embed"), ("POST", "/predict")]:
        assert key in table
    assert ("GET", "/v1/models") not in table  # answers a dict: FastAPI serialises it


def test_the_table_keeps_the_routers_first_match():
    async def exact(request: Request) -> Response:
        return Response(b"exact")

    async def param(name: str) -> Response:
        return Response(name.encode())

    async def with_body(request: Request, n: int) -> Response:
        return Response(b"")

    async def returns_dict(request: Request) -> dict:
        return {}

    first, second = APIRouter(), APIRouter()
    first.add_api_route("/items/{name}", param, methods=["GET"])
    first.add_api_route("/a", exact, methods=["POST"])
    second.add_api_route("/items/special", exact, methods=["GET", "POST"])  # GET is taken by /items/{name}
    second.add_api_route("/a", exact, methods=["POST"])  # taken by the first router's /a
    second.add_api_route("/b", with_body, methods=["POST"])
    second.add_api_route("/c", returns_dict, methods=["POST"])
    app = FastAPI()
    app.include_router(first)
    app.include_router(second)
    table = express_routes(app.router.routes)
    assert set(table) == {("POST", "/a"), ("POST", "/items/special")}
    assert table[("POST", "/a")] is first.routes[1]
    assert table[("POST", "/items/special")] is second.routes[0]
    assert not eligible(first.routes[0]) and not eligible(second.routes[2]) and not eligible(second.routes[3])


def test_a_route_inserted_after_the_first_request_is_served():
    """As a front end's /metrics: a route put first after the app was made answers its path."""
    from starlette.testclient import TestClient

    from server.http.express import ExpressLane

    async def old(request: Request) -> Response:
        return Response(b"old")

    async def new(request: Request) -> Response:
        return Response(b"new")

    app = FastAPI()
    app.add_api_route("/a", old, methods=["POST"])
    app.add_middleware(ExpressLane, routes=app.router.routes, exception_handlers=app.exception_handlers)
    with TestClient(app) as client:
        assert client.post("/a").content == b"old"
        app.add_api_route("/a", new, methods=["POST"])
        app.router.routes.insert(0, app.router.routes.pop())
        assert client.post("/a").content == b"new"

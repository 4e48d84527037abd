"""The OpenAPI schema is the contract: schemathesis drives a real server (uvicorn on a loopback
port, the embedding fixture) from /openapi.json, a bounded number of cases per operation, and
every answer must conform: documented status codes with their error bodies, truthful content
types, an Allow header on 405, no 5xx, and bodies the schema admits are accepted on every route
the loaded model serves (the reranker's and the classifier's routes on their own fixtures)."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis not installed (pip install '.[test]')")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

from tests.serving import ServerThread, cached_runner  # noqa: E402

from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

CASES_PER_OPERATION = 25


def serve(model_dir):
    from server.app import create_app
    from server.config import ServerConfig

    app = create_app(ServerConfig(model_id=str(model_dir), max_client_batch_size=8, max_batch_tokens=512),
                     runner=cached_runner(str(model_dir)))
    return ServerThread(app)


@pytest.fixture(scope="module")
def server(tiny_embedding_dir):
    with serve(tiny_embedding_dir) as srv:
        yield srv


def conformance_failures(url: str, *, served_only: bool = False) -> dict[str, str]:
    """Each operation's schemathesis failures (every check, positive data acceptance included).

    A POST route of another model kind (/rerank on an embedding model, ...) answers a documented
    400 naming the route to use, and /embed_sparse (deprecated in the schema) is never served: for
    those operations no body is accepted, so positive data acceptance is checked only on the
    routes /info lists as running the loaded model and on the model-independent ones (POST / and
    /invocations dispatch to the model's route; /tokenize, /decode). ``served_only``: only the
    model's routes and the dispatching ones."""
    import httpx
    from hypothesis import given

    from server.routes.tei import DISPATCHED, UNSERVED
    from server.service.heads import ROUTES

    served = set(httpx.get(url + "/info").json()["routes"])
    refused = {route for kind in ROUTES.values() for route in kind} - served | set(UNSERVED)
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    failures: dict[str, str] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 15
    accepting = set()
    for operation in operations:
        post = operation.method.upper() == "POST"
        if served_only and not (post and (operation.path in served or operation.path in DISPATCHED)):
            continue
        excluded = [positive_data_acceptance] if post and operation.path in refused else []
        if post and not excluded:
            accepting.add(operation.path)

        @settings(max_examples=CASES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=operation.as_strategy())
        def run(case):
            case.call_and_validate(base_url=url, excluded_checks=excluded)

        try:
            run()
        except BaseException as exc:  # noqa: BLE001 - every operation's failures (a group) are collected
            failures[operation.label] = str(exc)[:1500]
    documented = {operation.path for operation in operations}  # /embeddings is an undocumented alias
    assert (served | set(DISPATCHED)) & documented <= accepting, accepting  # the model's routes take valid bodies
    return failures


def test_every_operation_conforms(server):
    failures = conformance_failures(server.url)
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())


@pytest.mark.parametrize("preset", ["tiny-reranker", "tiny-qwen3-seq-cls-3"])
def test_scoring_routes_conform(preset, fixture_root):
    """The reranker's and the classifier's own routes, driven the same way."""
    import fixtures

    with serve(fixtures.cached(preset, root=fixture_root)) as srv:
        failures = conformance_failures(srv.url, served_only=True)
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())


def test_schema_refuses_what_the_server_refuses(server):
    import httpx
    import jsonschema

    spec = httpx.get(server.url + "/openapi.json").json()
    embed = spec["paths"]["/embed"]["post"]
    body = embed["requestBody"]["content"]["application/json"]["schema"]
    for bad in ({"inputs": ""}, {"inputs": []}, {"inputs": ["a", ""]}, {"inputs": ["a"] * 9},
                {"inputs": "a", "truncation_direction": "middle"}, {"inputs": [[1, -1]]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, body)
        assert 400 <= httpx.post(server.url + "/embed", json=bad).status_code < 500, bad
    jsonschema.validate({"inputs": ["a", "b"], "truncation_direction": "Left"}, body)
    for status in ("400", "413", "415", "422", "429", "431", "503"):
        assert embed["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorTEI")
    v1 = spec["paths"]["/v1/embeddings"]["post"]["responses"]["422"]["content"]["application/json"]["schema"]
    assert v1["$ref"].endswith("ErrorOpenAI")
    for path in ("/", "/health", "/ping"):
        assert "content" not in spec["paths"][path]["get"]["responses"]["200"]
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.content == b""
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")


def test_head_on_get_routes_and_allow_on_405(server):
    import httpx

    for path in ("/health", "/info", "/metrics", "/v1/models", "/openapi.json"):
        head, get = httpx.head(server.url + path), httpx.get(server.url + path)
        assert head.status_code == 200 and head.content == b"", path
        assert head.headers.get("content-type") == get.headers.get("content-type")
    wrong = httpx.get(server.url + "/embed")
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"], wrong.headers
    wrong = httpx.post(server.url + "/health", json={})
    assert wrong.status_code == 405 and "GET" in wrong.headers["allow"]


def test_whole_floats_are_integers_and_fractions_are_not():
    """JSON Schema's ``integer`` admits 18.0: the server takes it as 18, and refuses 18.5, "18" and true."""
    from server.http.bodies import parse_bytes
    from server.http.errors import ApiError
    from server.schemas.openai import OpenAIEmbeddingRequest
    from server.schemas.tei import EmbedRequest
    from server.schemas.tei import DecodeRequest

    assert parse_bytes(b'{"inputs": "a", "dimensions": 18.0}', EmbedRequest, max_items=8).dimensions == 18
    assert parse_bytes(b'{"input": [[3.0, 4]]}', OpenAIEmbeddingRequest, max_items=8).input == [[3, 4]]
    ids = parse_bytes(b'{"ids": [5.0, 6]}', DecodeRequest, max_items=8).ids
    assert ids == [5, 6] and all(type(i) is int for i in ids)
    for raw, model in ((b'{"inputs": "a", "dimensions": 18.5}', EmbedRequest),
                       (b'{"inputs": "a", "dimensions": "18"}', EmbedRequest),
                       (b'{"inputs": "a", "dimensions": true}', EmbedRequest),
                       (b'{"input": [3.0, 4.5]}', OpenAIEmbeddingRequest),
                       (b'{"ids": [[5, 6.5]]}', DecodeRequest)):
        with pytest.raises(ApiError):
            parse_bytes(raw, model, max_items=8)

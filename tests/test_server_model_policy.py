"""The ``model`` a request names (server/service/model_names.py), on every route that reads it,
through a real server: started without --served-model-name any name is served (TEI's behaviour:
clients' defaults such as ``text-embedding-3-small``, LangChain's ``text-embedding-ada-002``,
the README's hub id); started with it, a name it does not serve is a 404 ``model_not_found`` in
the route's dialect (vLLM's behaviour), counted in ``te_request_failure``, and its names, the
model id and Infinity's client's default are served. Answers with a foreign name equal the
answers without one (values compared within the prefix cache's bound)."""
from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from tests.client_checks import CACHE_ATOL
from tests.serving import serve

TEXTS = ["what is the capital of france", "paris is the capital of france"]
QUERY, DOCS = "capital of France", ["Paris is the capital.", "Berlin is in Germany."]
FOREIGN = ("text-embedding-3-small", "text-embedding-ada-002", "Qwen/Qwen3-Embedding-0.6B", "gpt-4")

# (path, body without model, how to read the answer's values)
EMBEDDING_ROUTES = [
    ("/v1/embeddings", {"input": TEXTS}, lambda j: [d["embedding"] for d in j["data"]]),
    ("/embeddings", {"input": TEXTS}, lambda j: [d["embedding"] for d in j["data"]]),
    ("/v1/embed", {"texts": TEXTS, "input_type": "search_document"}, lambda j: j["embeddings"]),
    ("/v2/embed", {"texts": TEXTS, "input_type": "search_document"}, lambda j: j["embeddings"]["float"]),
    ("/", {"texts": TEXTS, "input_type": "search_document"}, lambda j: j["embeddings"]),  # Cohere's body at POST /
]
RERANK_ROUTES = [
    ("/v1/rerank", {"query": QUERY, "documents": DOCS}, lambda j: [r["relevance_score"] for r in j["results"]]),
    ("/v2/rerank", {"query": QUERY, "documents": DOCS}, lambda j: [r["relevance_score"] for r in j["results"]]),
    ("/rerank", {"query": QUERY, "documents": DOCS}, lambda j: [r["relevance_score"] for r in j["results"]]),
    ("/", {"query": QUERY, "documents": DOCS}, lambda j: [r["relevance_score"] for r in j["results"]]),
    ("/infinity/rerank", {"query": QUERY, "documents": DOCS}, lambda j: [r["relevance_score"] for r in j["results"]]),
    ("/score", {"text_1": QUERY, "text_2": DOCS}, lambda j: [r["score"] for r in j["data"]]),
    ("/v1/score", {"text_1": QUERY, "text_2": DOCS}, lambda j: [r["score"] for r in j["data"]]),
]


@pytest.fixture(scope="module")
def servers(tiny_embedding_dir, tiny_reranker_dir):
    started = {
        ("embedding", False): serve(tiny_embedding_dir),
        ("embedding", True): serve(tiny_embedding_dir, served_model_name="tiny,text-embedding-3-small"),
        ("reranker", False): serve(tiny_reranker_dir),
        ("reranker", True): serve(tiny_reranker_dir, served_model_name="rr"),
    }
    yield started
    for srv in started.values():
        srv.stop()


def post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=300)


def failures(srv) -> float:
    m = re.search(r'^te_request_failure\{err="model_not_found"\} (\S+)$',
                  httpx.get(srv.url + "/metrics", timeout=120).text, flags=re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("kind,routes", [("embedding", EMBEDDING_ROUTES), ("reranker", RERANK_ROUTES)])
def test_without_served_names_any_model_is_served(servers, kind, routes):
    srv = servers[(kind, False)]
    for path, body, values in routes:
        want = post(srv, path, body)
        assert want.status_code == 200, (path, want.text)
        for model in FOREIGN:
            r = post(srv, path, {**body, "model": model})
            assert r.status_code == 200, (path, model, r.text)
            np.testing.assert_allclose(values(r.json()), values(want.json()), atol=CACHE_ATOL)


@pytest.mark.parametrize("kind,routes,served", [
    ("embedding", EMBEDDING_ROUTES, ("tiny", "text-embedding-3-small")), ("reranker", RERANK_ROUTES, ("rr",))])
def test_with_served_names_another_model_is_404(servers, kind, routes, served, request):
    srv = servers[(kind, True)]
    model_id = str(request.getfixturevalue(f"tiny_{kind}_dir"))
    for path, body, _ in routes:
        for model in (*served, model_id, "default/not-specified"):
            r = post(srv, path, {**body, "model": model})
            assert r.status_code == 200, (path, model, r.text)
        before = failures(srv)
        r = post(srv, path, {**body, "model": "gpt-4"})
        assert r.status_code == 404, (path, r.text)
        error = r.json()["error"]
        if isinstance(error, dict):  # OpenAI's shape on /v1 routes
            assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error", error
            message = error["message"]
        else:  # TEI's
            assert r.json()["error_type"] == "NotFound", r.json()
            message = error
        assert "`gpt-4` does not exist" in message and all(f"`{n}`" in message for n in served), message
        assert failures(srv) == before + 1

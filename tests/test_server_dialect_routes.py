"""The routes vLLM's, Infinity's, Cohere's and LangChain's users call, through a real uvicorn server:
vLLM's GET /version, an unknown ``model`` on /v1/embeddings as vLLM answers it (404
``model_not_found``), Infinity's GET /models and ``dimensions: 0``, Cohere's embed body at POST /,
a reranker's POST / naming /rerank to a text-classification call, and token-id input refused by
default (LangChain's OpenAIEmbeddings with its defaults sends tiktoken's ids). Values are compared
with the same server's own routes, within the prefix cache's bound (tests/client_checks.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.client_checks import CACHE_ATOL, LOADED
from tests.serving import serve

TEXTS = ["what is the capital of france", "paris is the capital of france"]


@pytest.fixture(scope="module")
def emb(tiny_embedding_dir):
    srv = serve(tiny_embedding_dir, served_model_name="tiny,text-embedding-3-small")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def rr(tiny_reranker_dir):
    srv = serve(tiny_reranker_dir)
    yield srv
    srv.stop()


def post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


def embed(srv, texts, **body) -> np.ndarray:
    r = post(srv, "/embed", {"inputs": texts, **body})
    assert r.status_code == 200, r.text
    return np.asarray(r.json(), dtype=np.float32)


def test_version_is_the_servers(emb):
    r = httpx.get(emb.url + "/version", timeout=LOADED)
    assert r.status_code == 200 and r.json() == {"version": httpx.get(emb.url + "/info", timeout=LOADED).json()["version"]}


def test_an_unknown_model_is_404_and_every_served_name_is_accepted(emb, tiny_embedding_dir):
    want = embed(emb, TEXTS)
    for model in ("tiny", "text-embedding-3-small", str(tiny_embedding_dir), "default/not-specified", None):
        body = {"input": TEXTS, **({} if model is None else {"model": model})}
        r = post(emb, "/v1/embeddings", body)
        assert r.status_code == 200, (model, r.text)
        assert r.json()["model"] == "tiny"
        np.testing.assert_allclose([d["embedding"] for d in r.json()["data"]], want, atol=CACHE_ATOL)
    for path in ("/v1/embeddings", "/embeddings"):
        r = post(emb, path, {"input": TEXTS, "model": "gpt-4"})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
        assert "`gpt-4` does not exist" in error["message"] and "`tiny`" in error["message"]


def test_dimensions_zero_is_the_full_size(emb):
    r = post(emb, "/v1/embeddings", {"input": TEXTS, "dimensions": 0, "model": "default/not-specified",
                                     "modality": "text"})  # what infinity-client sends
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["embedding"] for d in r.json()["data"]], embed(emb, TEXTS), atol=CACHE_ATOL)


def test_infinitys_models_list_says_what_the_model_serves(emb, rr):
    for srv, capability in ((emb, "embed"), (rr, "rerank")):
        for path in ("/models", "/infinity/models"):
            r = httpx.get(srv.url + path, timeout=LOADED)
            assert r.status_code == 200, r.text
            (model,) = r.json()["data"]
            assert r.json()["object"] == "list" and model["capabilities"] == [capability]
            assert model["id"] == httpx.get(srv.url + "/info", timeout=LOADED).json()["served_model_name"]


def test_cohere_embed_body_at_the_root(emb):
    body = {"texts": TEXTS, "model": "tiny", "input_type": "search_query", "embedding_types": ["float"]}
    root, native = post(emb, "/", body), post(emb, "/v1/embed", body)
    assert root.status_code == 200 and native.status_code == 200, root.text
    assert root.json()["response_type"] == "embeddings_by_type"
    np.testing.assert_allclose(root.json()["embeddings"]["float"], native.json()["embeddings"]["float"],
                               atol=CACHE_ATOL)
    np.testing.assert_allclose(root.json()["embeddings"]["float"], embed(emb, TEXTS, prompt_name="query"),
                               atol=CACHE_ATOL)


def test_a_text_classification_call_on_a_reranker_names_rerank(rr):
    r = post(rr, "/", {"inputs": "i love this"})
    assert r.status_code == 400 and "use POST /rerank" in r.json()["error"], r.text
    hub = pytest.importorskip("huggingface_hub")
    with pytest.raises(Exception) as info:
        hub.InferenceClient(base_url=rr.url).text_classification("i love this")
    assert "/rerank" in str(info.value)


def test_token_ids_are_refused_unless_allowed(emb, tiny_embedding_dir):
    r = post(emb, "/v1/embeddings", {"input": [[15339, 1917]], "model": "tiny"})
    assert r.status_code == 422 and "check_embedding_ctx_length=False" in r.json()["error"]["message"], r.text
    assert "--allow-token-ids" in r.json()["error"]["message"]
    allowed = serve(tiny_embedding_dir, allow_token_ids=True)
    try:
        ids = httpx.post(allowed.url + "/tokenize", json={"inputs": TEXTS[0]}, timeout=LOADED).json()[0]
        r = post(allowed, "/v1/embeddings", {"input": [[t["id"] for t in ids]]})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], embed(allowed, TEXTS[:1])[0], atol=CACHE_ATOL)
    finally:
        allowed.stop()


CL100K_FILE = "9b5ad71b2ce5302211f9c61530b329a4922fc6a4"  # tiktoken's cache name: sha1 of cl100k_base's URL


def _cl100k_cache() -> str:
    """A directory holding tiktoken's cl100k_base file offline: litellm and llama-index ship it."""
    for package, sub in (("litellm", "litellm_core_utils/tokenizers"), ("llama_index.core", "_static/tiktoken_cache")):
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            continue
        for root in (spec.submodule_search_locations or []) if spec else []:
            if (Path(root) / sub / CL100K_FILE).exists():
                return str(Path(root) / sub)
    pytest.skip("no offline copy of tiktoken's cl100k_base (litellm or llama-index ships one)")


def test_langchain_openai_embeddings_defaults_get_an_error_not_wrong_vectors(emb, monkeypatch):
    lc = pytest.importorskip("langchain_openai")
    pytest.importorskip("tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", _cl100k_cache())
    model = lc.OpenAIEmbeddings(model="tiny", base_url=emb.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(Exception) as info:
        model.embed_documents(TEXTS)
    assert "check_embedding_ctx_length=False" in str(info.value)
    fixed = lc.OpenAIEmbeddings(model="tiny", base_url=emb.url + "/v1", api_key="unused", max_retries=0,
                                check_embedding_ctx_length=False)
    np.testing.assert_allclose(fixed.embed_documents(TEXTS), embed(emb, TEXTS), atol=CACHE_ATOL)

"""The client libraries people already use, unchanged, against a real radixserve (uvicorn on
loopback): openai, huggingface_hub's InferenceClient, cohere (Client and ClientV2), langchain-openai,
llama-index's TEI embeddings, haystack's TEI sparse embedder (the clear error of a route not served). Values are checked against the server's own /embed and /rerank.

The libraries come from the ``clients`` extra (.ci/run installs it); a missing one skips its test.
One embedding server and one reranker server per module: these imports are slow.
"""
from __future__ import annotations


import httpx
import numpy as np
import pytest

from tests.client_checks import CACHE_ATOL, assert_ranked, dot_atol
from tests.serving import ServerThread, serve

TEXTS = [
    "what is the capital of france",
    "paris is the capital and most populous city of france",
    "berlin is the capital of germany",
    "a completely unrelated sentence about cooking pasta",
]
QUERY = "what is the capital of france"
DOCS = TEXTS[1:]


def _serve(model_dir, **over) -> ServerThread:
    return serve(model_dir, served_model_name="tiny", **over)


@pytest.fixture(scope="module")
def emb(tiny_embedding_dir):
    # OpenAI's own limit (2048 inputs per request) with permits for it: LangChain sends 1000.
    srv = _serve(tiny_embedding_dir, max_client_batch_size=2048, max_concurrent_requests=4096)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def rr(tiny_reranker_dir):
    srv = _serve(tiny_reranker_dir)
    yield srv
    srv.stop()


def native_embed(srv, texts, **body) -> np.ndarray:
    r = httpx.post(srv.url + "/embed", json={"inputs": texts, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return np.asarray(r.json(), dtype=np.float32)


def native_rerank(srv, query, texts) -> dict[int, float]:
    r = httpx.post(srv.url + "/rerank", json={"query": query, "texts": texts}, timeout=120)
    assert r.status_code == 200, r.text
    return {x["index"]: x["score"] for x in r.json()}


def test_openai_sdk(emb):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=emb.url + "/v1", api_key="unused", max_retries=0)
    want = native_embed(emb, TEXTS)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], want, atol=CACHE_ATOL)
    b64 = client.embeddings.create(model="tiny", input=TEXTS)  # the SDK asks for base64 and decodes it
    np.testing.assert_allclose([d.embedding for d in b64.data], want, atol=CACHE_ATOL)
    dims = client.embeddings.create(model="tiny", input=TEXTS, dimensions=16)
    np.testing.assert_allclose([d.embedding for d in dims.data], native_embed(emb, TEXTS, dimensions=16), atol=CACHE_ATOL)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_huggingface_inference_client(emb):
    hub = pytest.importorskip("huggingface_hub")
    want = native_embed(emb, TEXTS[:1])
    root = hub.InferenceClient(base_url=emb.url)
    np.testing.assert_allclose(np.asarray(root.feature_extraction(TEXTS[0])).reshape(want.shape), want, atol=CACHE_ATOL)
    at_embed = hub.InferenceClient(model=emb.url + "/embed")
    np.testing.assert_allclose(np.asarray(at_embed.feature_extraction(TEXTS[0])).reshape(want.shape), want, atol=CACHE_ATOL)
    sims = root.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    e = native_embed(emb, TEXTS)
    np.testing.assert_allclose(sims, e[1:] @ e[0], atol=dot_atol(e.shape[1]))


def test_cohere_v2(emb, rr):
    cohere = pytest.importorskip("cohere")
    ranked = cohere.ClientV2(api_key="unused", base_url=rr.url).rerank(model="tiny", query=QUERY, documents=DOCS, top_n=2)
    assert_ranked([(r.index, r.relevance_score) for r in ranked.results], native_rerank(rr, QUERY, DOCS), 2)
    client = cohere.ClientV2(api_key="unused", base_url=emb.url)
    out = client.embed(texts=TEXTS, model="tiny", input_type="search_query", embedding_types=["float", "base64"])
    want = native_embed(emb, TEXTS, prompt_name="query")
    np.testing.assert_allclose(out.embeddings.float_, want, atol=CACHE_ATOL)
    docs = client.embed(texts=TEXTS, model="tiny", input_type="search_document", embedding_types=["float"])
    np.testing.assert_allclose(docs.embeddings.float_, native_embed(emb, TEXTS), atol=CACHE_ATOL)


def test_cohere_v1(emb, rr):
    cohere = pytest.importorskip("cohere")
    ranked = cohere.Client(api_key="unused", base_url=rr.url).rerank(model="tiny", query=QUERY, documents=DOCS)
    assert_ranked([(r.index, r.relevance_score) for r in ranked.results], native_rerank(rr, QUERY, DOCS), len(DOCS))
    out = cohere.Client(api_key="unused", base_url=emb.url).embed(texts=TEXTS, model="tiny", input_type="search_query")
    np.testing.assert_allclose(out.embeddings, native_embed(emb, TEXTS, prompt_name="query"), atol=CACHE_ATOL)


def test_langchain_openai_embeddings_defaults_on_1000_documents(emb):
    lc = pytest.importorskip("langchain_openai")
    docs = [f"document number {i} about {TEXTS[i % len(TEXTS)]}" for i in range(1000)]
    # Defaults (chunk_size=1000: one request of 1000 inputs), except the context-length check,
    # which needs tiktoken's cl100k_base from the internet; with it off, LangChain sends strings.
    model = lc.OpenAIEmbeddings(model="tiny", base_url=emb.url + "/v1", api_key="unused",
                                check_embedding_ctx_length=False, max_retries=0)
    got = np.asarray(model.embed_documents(docs), dtype=np.float32)
    assert got.shape[0] == 1000
    pick = [0, 1, 517, 999]
    np.testing.assert_allclose(got[pick], native_embed(emb, [docs[i] for i in pick]), atol=CACHE_ATOL)
    np.testing.assert_allclose(model.embed_query(QUERY), native_embed(emb, [QUERY])[0], atol=CACHE_ATOL)


def test_llama_index_tei_embedding(emb):
    tei = pytest.importorskip("llama_index.embeddings.text_embeddings_inference")
    model = tei.TextEmbeddingsInference(model_name="tiny", base_url=emb.url, timeout=120)
    np.testing.assert_allclose(model.get_text_embedding(TEXTS[1]), native_embed(emb, [TEXTS[1]])[0], atol=CACHE_ATOL)
    got = model.get_text_embedding_batch(TEXTS)
    np.testing.assert_allclose(got, native_embed(emb, TEXTS), atol=CACHE_ATOL)


def test_haystack_tei_sparse_embedder_gets_a_clear_error(emb):
    """haystack's SPLADE embedder posts TEI's /embed_sparse: a 400 that says what to use instead."""
    hf_api = pytest.importorskip("haystack_integrations.components.embedders.huggingface_api",
                                 reason="huggingface-api-haystack is not installed")
    embedder = hf_api.HuggingFaceTEISparseTextEmbedder(api_base_url=emb.url)
    with pytest.raises(httpx.HTTPStatusError) as info:
        embedder.run(text=QUERY)
    answer = info.value.response
    assert answer.status_code == 400 and answer.json()["error_type"] == "Validation"
    assert "SPLADE" in answer.json()["error"] and "use /embed or /v1/embeddings" in answer.json()["error"]

"""TEI/Cohere/OpenAI compatibility routes through a real uvicorn server and the real Scheduler.

Oracles: transformers' Qwen3Model (last hidden state, after the final norm) for /embed_all, per
token, with the radix index on (shared prefixes in one batch) and off; otherwise the server's own
/embed and /rerank answers, which test_server_embed/test_server_rerank hold to transformers, compared
within the prefix cache's bound (a native call may have warmed the cache the compat call reads).
"""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from tests.client_checks import CACHE_ATOL, LOADED, dot_atol
from tests.serving import cached_runner, serve

TEXTS = [
    "what is the capital of france",
    "what is the capital of france and why is it paris",
    "what is the capital of germany",
    "paris is the capital and most populous city of france",
]


@pytest.fixture(scope="module", params=[1.0, 0.0], ids=["radix-on", "radix-off"])
def emb_srv(request, tiny_embedding_dir):
    srv = serve(tiny_embedding_dir, radix_mlp_threshold=request.param)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def rr_srv(tiny_reranker_dir):
    srv = serve(tiny_reranker_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf_model(tiny_embedding_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(tiny_embedding_dir), dtype=torch.float32).eval()


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def test_embed_all_rows_are_transformers_hidden_states(emb_srv, hf_model):
    tok = cached_runner(str(hf_model.name_or_path)).tokenizer
    r = post(emb_srv, "/embed_all", {"inputs": TEXTS})
    assert r.status_code == 200, r.text
    assert {"x-queue-time", "x-inference-time", "x-total-time", "x-compute-tokens"} <= set(r.headers)
    out = r.json()
    assert len(out) == len(TEXTS)
    for states, text in zip(out, TEXTS):
        ids = tok.encode(text).ids  # the tokenizer appends <|endoftext|>, as /embed does
        with torch.inference_mode():
            want = hf_model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()  # [L, E]
        got = np.asarray(states, dtype=np.float32)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # The last row is the pooled state: /embed with normalize=false answers the same vector.
    pooled = post(emb_srv, "/embed", {"inputs": TEXTS, "normalize": False}).json()
    for states, vec in zip(out, pooled):
        np.testing.assert_allclose(states[-1], vec, atol=CACHE_ATOL, rtol=0)


def test_embed_all_on_the_index_used_it(emb_srv, tiny_embedding_dir):
    """With threshold 1 the shared prefixes really went through the trie (not an unrelated path)."""
    info = httpx.get(emb_srv.url + "/info", timeout=LOADED).json()

    def tokens(kind: str) -> float:
        lines = httpx.get(emb_srv.url + "/metrics", timeout=LOADED).text.splitlines()
        return float(next(l for l in lines if l.startswith(f'radixserve_tokens_total{{kind="{kind}"}}')).split()[-1])

    # NOTE: deltas over this request only: earlier /embed requests on this server may have been
    # served partly by the prefix cache (fewer computed rows even with the trie off).
    c0, o0 = tokens("compact"), tokens("original")
    post(emb_srv, "/embed_all", {"inputs": TEXTS[:2]})
    c, o = tokens("compact") - c0, tokens("original") - o0
    assert o > 0
    if info["radix_mlp_threshold"] >= 1.0:
        assert c < o
    else:
        assert c == o


def test_root_and_invocations_dispatch_by_shape(emb_srv):
    embed = post(emb_srv, "/embed", {"inputs": TEXTS[:2]}).json()
    for path in ("/", "/invocations"):
        r = post(emb_srv, path, {"inputs": TEXTS[:2]})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json(), embed, atol=CACHE_ATOL)
        sim = post(emb_srv, path, {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}})
        assert sim.status_code == 200, sim.text
        e = np.asarray(post(emb_srv, "/embed", {"inputs": TEXTS}).json())
        np.testing.assert_allclose(sim.json(), e[1:] @ e[0], atol=dot_atol(e.shape[1]))
        bad = post(emb_srv, path, {"inputs": 3})
        assert bad.status_code == 422 and bad.json()["error_type"] == "Validation"
    assert httpx.get(emb_srv.url + "/", timeout=LOADED).status_code == 200
    assert httpx.get(emb_srv.url + "/ping", timeout=LOADED).status_code == 200


def test_similarity_checks(emb_srv):
    r = post(emb_srv, "/similarity", {"inputs": {"source_sentence": "a", "sentences": []}})
    assert r.status_code == 400 and r.json()["error_type"] == "Empty"
    params = {"prompt_name": "query", "truncate": True, "truncation_direction": "Left"}
    r = post(emb_srv, "/similarity", {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:3]},
                                      "parameters": params})
    e = np.asarray(post(emb_srv, "/embed", {"inputs": TEXTS[:3], "prompt_name": "query"}).json())
    np.testing.assert_allclose(r.json(), e[1:] @ e[0], atol=dot_atol(e.shape[1]))


def test_decode(emb_srv):
    tok = cached_runner(str(httpx.get(emb_srv.url + "/info", timeout=LOADED).json()["model_id"])).tokenizer
    ids = [tok.encode(t).ids for t in TEXTS[:2]]
    r = post(emb_srv, "/decode", {"ids": ids})
    assert r.json() == TEXTS[:2]  # <|endoftext|> is special: skipped by default
    one = post(emb_srv, "/decode", {"ids": ids[0], "skip_special_tokens": False}).json()
    assert one == [TEXTS[0] + "<|endoftext|>"]
    assert post(emb_srv, "/decode", {"ids": []}).json() == [""]
    assert post(emb_srv, "/decode", {"ids": [[]]}).json() == [""]
    assert post(emb_srv, "/decode", {"ids": [[1, 10**9]]}).status_code == 422
    assert post(emb_srv, "/decode", {"ids": [[-1]]}).status_code == 422
    assert post(emb_srv, "/decode", {"ids": "abc"}).status_code == 422


def test_info_has_tei_fields(emb_srv):
    info = httpx.get(emb_srv.url + "/info", timeout=LOADED).json()
    for key in ("model_id", "model_sha", "model_dtype", "served_model_name", "model_type", "max_concurrent_requests",
                "max_input_length", "max_batch_tokens", "max_batch_requests", "max_client_batch_size",
                "auto_truncate", "tokenization_workers", "version", "sha", "docker_label", "prompts",
                "radix_mlp_threshold", "radix_attention"):
        assert key in info, key
    assert info["model_sha"] is None  # a local directory has no hub commit
    assert info["prompts"]["query"].startswith("Instruct:")


def test_cohere_embed_shapes_and_values(emb_srv):
    query = np.asarray(post(emb_srv, "/embed", {"inputs": TEXTS[:2], "prompt_name": "query"}).json())
    doc = np.asarray(post(emb_srv, "/embed", {"inputs": TEXTS[:2]}).json())
    v1 = post(emb_srv, "/v1/embed", {"texts": TEXTS[:2], "input_type": "search_query"}).json()
    assert v1["response_type"] == "embeddings_floats" and v1["texts"] == TEXTS[:2] and v1["id"]
    np.testing.assert_allclose(v1["embeddings"], query, atol=CACHE_ATOL)
    for version in ("v1", "v2"):
        body = {"texts": TEXTS[:2], "input_type": "search_document", "embedding_types": ["float", "base64"]}
        r = post(emb_srv, f"/{version}/embed", body).json()
        assert r["response_type"] == "embeddings_by_type"
        np.testing.assert_allclose(r["embeddings"]["float"], doc, atol=CACHE_ATOL)
        b64 = [np.frombuffer(base64.b64decode(s), dtype="<f4") for s in r["embeddings"]["base64"]]
        np.testing.assert_allclose(b64, doc, atol=CACHE_ATOL)
    clus = post(emb_srv, "/v2/embed", {"texts": TEXTS[:2], "input_type": "clustering"}).json()
    np.testing.assert_allclose(clus["embeddings"]["float"], doc, atol=CACHE_ATOL)  # symmetric: the document prompt
    dims = post(emb_srv, "/v2/embed", {"texts": TEXTS[:1], "input_type": "search_document", "output_dimension": 8}).json()
    np.testing.assert_allclose(dims["embeddings"]["float"][0], doc[0, :8] / np.linalg.norm(doc[0, :8]), atol=dot_atol(8))
    for body, status in (({"texts": ["a"], "embedding_types": ["int8"]}, 422),
                         ({"texts": ["a"], "embedding_types": ["nope"]}, 422),
                         ({"texts": ["a"], "input_type": "image"}, 422),
                         ({"images": ["data:image/png;base64,AA=="]}, 422),
                         ({"texts": []}, 400), ({}, 422)):
        r = post(emb_srv, "/v2/embed", body)
        assert r.status_code == status, (body, r.text)


def test_openai_models(emb_srv):
    name = httpx.get(emb_srv.url + "/info", timeout=LOADED).json()["served_model_name"]
    listed = httpx.get(emb_srv.url + "/v1/models", timeout=LOADED).json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [name]
    one = httpx.get(emb_srv.url + "/v1/models/" + name, timeout=LOADED)
    assert one.status_code == 200 and one.json()["id"] == name
    missing = httpx.get(emb_srv.url + "/v1/models/not-this-one", timeout=LOADED)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_wrong_model_kind_is_clear(emb_srv, rr_srv):
    assert post(emb_srv, "/v2/rerank", {"query": "q", "documents": ["d"]}).status_code == 400
    assert post(rr_srv, "/embed_all", {"inputs": "x"}).status_code == 400
    assert post(rr_srv, "/v1/embed", {"texts": ["x"]}).status_code == 400


@pytest.mark.parametrize("path,what", [("/predict", "'classifier'"), ("/embed_sparse", "SPLADE")])
def test_teis_unserved_routes_say_which_route_to_use(emb_srv, rr_srv, path, what):
    """TEI's classifier route on another head, and SPLADE: a 400 in TEI's shape naming the route to
    use, not a bare 404."""
    for srv, use in ((emb_srv, "use /embed or /v1/embeddings"), (rr_srv, "use /rerank or /v1/rerank")):
        r = post(srv, path, {"inputs": "a"})
        assert r.status_code == 400, r.text
        body = r.json()
        assert set(body) == {"error", "error_type"} and body["error_type"] == "Validation"
        assert what in body["error"] and use in body["error"]
        assert path == "/predict" or "dense embeddings and rerankers" in body["error"]
    assert httpx.get(emb_srv.url + path, timeout=LOADED).status_code == 405


def test_reranker_root_and_cohere_v2(rr_srv):
    docs = ["paris is the capital of france", "", "berlin is in germany", "cooking pasta"]
    native = post(rr_srv, "/rerank", {"query": "capital of france", "texts": [d or "x" for d in docs]}).json()
    root = post(rr_srv, "/", {"query": "capital of france", "texts": [d or "x" for d in docs]}).json()
    # NOTE: not bit-equal: the second request reads the shared prefix's K/V from the prefix cache.
    assert [x["index"] for x in root] == [x["index"] for x in native]
    np.testing.assert_allclose([x["score"] for x in root], [x["score"] for x in native], atol=CACHE_ATOL)
    r = post(rr_srv, "/v2/rerank", {"query": "capital of france", "documents": docs, "top_n": 3,
                                    "model": "whatever", "max_tokens_per_doc": 4096})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] and body["meta"]["api_version"]["version"] == "2" and len(body["results"]) == 3
    scores = {x["index"]: x["relevance_score"] for x in body["results"]}
    by_native = {x["index"]: x["score"] for x in native}
    for i, s in scores.items():
        if docs[i]:
            assert s == pytest.approx(by_native[i], abs=1e-6)
    assert [x["relevance_score"] for x in body["results"]] == sorted(scores.values(), reverse=True)
    assert post(rr_srv, "/v2/rerank", {"query": "", "documents": ["a"]}).status_code == 400
    assert post(rr_srv, "/v2/rerank", {"query": "q", "documents": []}).status_code == 400


def test_new_routes_need_the_api_key(tiny_embedding_dir):
    srv = serve(tiny_embedding_dir, api_key="sekret")
    try:
        for path, body in (("/", {"inputs": "a"}), ("/invocations", {"inputs": "a"}), ("/embed_all", {"inputs": "a"}),
                           ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
                           ("/decode", {"ids": [1]}), ("/v1/embed", {"texts": ["a"]}), ("/v2/embed", {"texts": ["a"]})):
            assert post(srv, path, body).status_code == 401, path
            ok = post(srv, path, body, headers={"Authorization": "Bearer sekret"})
            assert ok.status_code == 200, (path, ok.text)
        assert httpx.get(srv.url + "/", timeout=LOADED).status_code == 200  # GET / is TEI's open health check
        assert httpx.get(srv.url + "/ping", timeout=LOADED).status_code == 200
    finally:
        srv.stop()


def test_openapi_lists_every_route(emb_srv):
    paths = httpx.get(emb_srv.url + "/openapi.json", timeout=LOADED).json()["paths"]
    for path, method in (("/", "post"), ("/", "get"), ("/invocations", "post"), ("/ping", "get"), ("/similarity", "post"),
                         ("/embed_all", "post"), ("/decode", "post"), ("/v1/embed", "post"), ("/v2/embed", "post"),
                         ("/v2/rerank", "post"), ("/v1/models", "get"), ("/v1/models/{model_id}", "get"),
                         ("/embed", "post"), ("/v1/embeddings", "post"), ("/rerank", "post"), ("/v1/rerank", "post"),
                         ("/tokenize", "post"), ("/info", "get"), ("/health", "get"), ("/metrics", "get")):
        assert method in paths.get(path, {}), (path, method)
    body = paths["/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(body["oneOf"]) == 2  # /embed's body or /similarity's


def test_compat_bodies_are_bounded(tiny_embedding_dir):
    """Counts checked by the body parser before validation; /embed_all's answer capped in tokens."""
    srv = serve(tiny_embedding_dir, max_batch_tokens=64, max_client_batch_size=4, max_concurrent_requests=8)
    try:
        five = ["a b c"] * 5
        for path, body, what in (("/decode", {"ids": [[1]] * 5}, "id lists"),
                                 ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"] * 4}},
                                  "sentences"),
                                 ("/", {"inputs": {"source_sentence": "a", "sentences": ["b"] * 4}}, "sentences"),
                                 ("/", {"inputs": five}, "inputs"), ("/embed_all", {"inputs": five}, "inputs"),
                                 ("/v1/embed", {"texts": five}, "texts"), ("/v2/embed", {"texts": five}, "texts")):
            r = post(srv, path, body)
            error = r.json()["error"]  # TEI's {"error": str} or, under /v1, OpenAI's {"error": {"message"}}
            message = error["message"] if isinstance(error, dict) else error
            assert r.status_code == 422 and f"5 {what} in one request" in message, (path, r.text)
        ok = post(srv, "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"] * 3}})
        assert ok.status_code == 200, ok.text
        long = post(srv, "/embed_all", {"inputs": [" ".join(["word"] * 30)] * 3})  # ~93 tokens > 64
        assert long.status_code == 422 and "more than the maximum of 64" in long.json()["error"], long.text
        assert post(srv, "/decode", {"ids": [[1, "x"]]}).status_code == 422
        bad = httpx.post(srv.url + "/", content=b"{not json", headers={"content-type": "application/json"},
                         timeout=LOADED)
        assert bad.status_code == 422 and bad.json()["error_type"] == "Validation"
    finally:
        srv.stop()


def test_embed_all_answer_is_bounded_by_max_embed_all_floats(emb_srv, tiny_embedding_dir):
    one = post(emb_srv, "/embed_all", {"inputs": TEXTS[:1]}).json()  # [1, L, E]
    floats = len(one[0]) * len(one[0][0])
    srv = serve(tiny_embedding_dir, max_embed_all_floats=floats)
    try:
        r = post(srv, "/embed_all", {"inputs": TEXTS[:1]})  # exactly at the limit
        assert r.status_code == 200 and np.asarray(r.json()).shape == np.asarray(one).shape
        r = post(srv, "/embed_all", {"inputs": TEXTS[:2]})
        assert r.status_code == 422, r.text
        assert r.json()["error_type"] == "Validation"
        message = r.json()["error"]
        assert f"maximum of {floats} (--max-embed-all-floats)" in message and "raise the limit" in message
        assert httpx.get(srv.url + "/health", timeout=LOADED).status_code == 200
    finally:
        srv.stop()

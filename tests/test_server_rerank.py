"""Rerank routes (TEI /rerank, Cohere/Jina /v1/rerank) through a real uvicorn server.

Oracle: transformers' AutoModelForCausalLM from the fixture, fp32, one pair at a time, on the
reference Qwen3-Reranker input (prefix + body + suffix, each encoded separately); raw score =
logit("yes") - logit("no") at the last token.
"""
from __future__ import annotations

import dataclasses
import math

import httpx
import numpy as np
import pytest
import torch

from models.text import prompts
from server.app import create_app
from server.config import ServerConfig
from tests.serving import ServerThread, cached_runner
from tests.limits import measure

QUERY = "what is the capital of france"
DOCS = [
    "paris is the capital and most populous city of france",
    "paris is the capital and most populous city of france, with 2.1 million residents",
    "berlin is the capital of germany",
    "a completely unrelated sentence about cooking pasta",
    "paris",
]


@pytest.fixture(scope="module")
def runner(tiny_reranker_dir):
    return cached_runner(str(tiny_reranker_dir))


@pytest.fixture(scope="module")
def oracle(tiny_reranker_dir, runner):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_reranker_dir), dtype=torch.float32).eval()
    tok = runner.tokenizer
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")

    def score(query: str, doc: str, instruction: str = prompts.DEFAULT_INSTRUCTION) -> float:
        body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
        ids = (tok.encode(prompts.RERANK_PREFIX, add_special_tokens=False).ids
               + tok.encode(body, add_special_tokens=False).ids
               + tok.encode(prompts.RERANK_SUFFIX, add_special_tokens=False).ids)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]  # [V]
        return float(logits[yes] - logits[no])

    return score


@pytest.fixture(scope="module")
def servers(runner, tiny_reranker_dir):
    def start(r, **kw):
        config = ServerConfig(model_id=str(tiny_reranker_dir), **{"max_client_batch_size": 8, **kw})
        return ServerThread(create_app(config, runner=r)).start()

    started = {
        "compact": start(runner, radix_mlp_threshold=1.0),
        "paper": start(dataclasses.replace(runner, radix_attention="paper"), radix_mlp_threshold=1.0),
        "off": start(runner, radix_mlp_threshold=0.0),
        "short": start(runner, max_input_length=150, auto_truncate=False),
        "wide": start(runner, max_input_length=200, auto_truncate=False, max_client_batch_size=64),
    }
    yield started
    for s in started.values():
        s.stop()


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("mode", ["compact", "paper", "off"])
def test_rerank_matches_transformers(servers, oracle, mode):
    url = servers[mode].url
    ref = np.array([oracle(QUERY, d) for d in DOCS])
    raw = httpx.post(url + "/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}, timeout=60)
    assert raw.status_code == 200, raw.text
    for h in ("x-queue-time", "x-inference-time", "x-total-time", "x-compute-tokens"):
        assert h in raw.headers
    got = raw.json()
    assert sorted(r["index"] for r in got) == list(range(len(DOCS)))
    assert [r["score"] for r in got] == sorted((r["score"] for r in got), reverse=True)
    for r in got:
        assert abs(r["score"] - ref[r["index"]]) < 1e-4
        assert "text" not in r
    soft = httpx.post(url + "/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True}, timeout=60).json()
    for r in soft:
        assert abs(r["score"] - sigmoid(ref[r["index"]])) < 1e-4 and r["text"] == DOCS[r["index"]]


def test_rerank_instruction(servers, oracle):
    body = {"query": QUERY, "texts": DOCS[:2], "raw_scores": True, "instruction": "Find the city"}
    got = httpx.post(servers["compact"].url + "/rerank", json=body, timeout=60).json()
    for r in got:
        assert abs(r["score"] - oracle(QUERY, DOCS[r["index"]], "Find the city")) < 1e-4


def test_v1_rerank_cohere_and_jina(servers, oracle, tiny_reranker_dir):
    url = servers["compact"].url
    ref = [sigmoid(oracle(QUERY, d)) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])
    r = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3, "model": "x"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == str(tiny_reranker_dir) and body["usage"]["total_tokens"] > 0
    assert [x["index"] for x in body["results"]] == order[:3]
    for x in body["results"]:
        assert abs(x["relevance_score"] - ref[x["index"]]) < 1e-4 and "document" not in x
    jina = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": True, "top_n": 100}
    body = httpx.post(url + "/v1/rerank", json=jina, timeout=60).json()
    assert [x["index"] for x in body["results"]] == order
    assert all(x["document"] == {"text": DOCS[x["index"]]} for x in body["results"])


@pytest.mark.parametrize("path", ["/rerank", "/"])
def test_rerank_documents_answer_in_vllms_dialect(servers, oracle, tiny_reranker_dir, path):
    """/rerank (and POST / on a reranker) with Cohere/Jina/Infinity/vLLM's ``documents``: vLLM's answer."""
    url = servers["compact"].url
    ref = [sigmoid(oracle(QUERY, d)) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])
    r = httpx.post(url + path, json={"query": QUERY, "documents": DOCS, "top_n": 3, "model": "m"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "model", "results", "usage"} and body["model"] == str(tiny_reranker_dir)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    assert [x["index"] for x in body["results"]] == order[:3]
    for x in body["results"]:  # unset return_documents answers them, as vLLM does
        assert abs(x["relevance_score"] - ref[x["index"]]) < 1e-4 and x["document"] == {"text": DOCS[x["index"]]}
    objects = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False}
    body = httpx.post(url + path, json=objects, timeout=60).json()
    assert [x["index"] for x in body["results"]] == order and all("document" not in x for x in body["results"])
    tei = httpx.post(url + path, json={"query": QUERY, "texts": DOCS}, timeout=60).json()
    assert [x["index"] for x in tei] == order and all(set(x) == {"index", "score"} for x in tei)
    told = {"query": QUERY, "documents": DOCS[:2], "instruction": "Find the city"}
    for x in httpx.post(url + path, json=told, timeout=60).json()["results"]:
        assert abs(x["relevance_score"] - sigmoid(oracle(QUERY, DOCS[x["index"]], "Find the city"))) < 1e-4


@pytest.mark.parametrize("body,status", [
    ({"query": QUERY, "documents": []}, 400),
    ({"query": "", "documents": ["a"]}, 400),
    ({"query": QUERY, "documents": ["a"] * 9}, 422),
    ({"query": QUERY, "documents": ["a"], "top_n": 0}, 422),
    ({"query": QUERY, "documents": [3]}, 422),
    ({"documents": ["a"]}, 422),
])
def test_rerank_documents_refusals_speak_tei(servers, body, status):
    r = httpx.post(servers["compact"].url + "/rerank", json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error", "error_type"}


def test_infinity_rerank(servers, oracle, tiny_reranker_dir):
    """/infinity/rerank answers Infinity's shape: a returned document is a plain string."""
    url = servers["compact"].url
    raw_ref = [oracle(QUERY, d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -raw_ref[i])
    body = {"query": QUERY, "documents": DOCS, "return_documents": True, "top_n": 4, "model": "m"}
    r = httpx.post(url + "/infinity/rerank", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "rerank" and got["model"] == str(tiny_reranker_dir) and got["id"]
    assert isinstance(got["created"], int) and got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] > 0
    assert [x["index"] for x in got["results"]] == order[:4]
    for x in got["results"]:
        assert abs(x["relevance_score"] - sigmoid(raw_ref[x["index"]])) < 1e-4 and x["document"] == DOCS[x["index"]]
    raw = httpx.post(url + "/infinity/rerank", json={"query": QUERY, "documents": DOCS, "raw_scores": True},
                     timeout=60).json()
    for x in raw["results"]:
        assert abs(x["relevance_score"] - raw_ref[x["index"]]) < 1e-4 and "document" not in x
    assert httpx.post(url + "/infinity/rerank", json={"query": QUERY, "documents": []}).status_code == 400


def test_rerank_truncation(servers, oracle):
    url = servers["short"].url
    long_doc = "lorem ipsum dolor sit amet " * 40
    refused = httpx.post(url + "/rerank", json={"query": QUERY, "texts": [long_doc]})
    assert refused.status_code == 422 and refused.json()["error_type"] == "Validation"
    refused_v1 = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": [long_doc]})
    assert refused_v1.status_code == 422 and refused_v1.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.post(url + "/rerank", json={"query": QUERY, "texts": [long_doc], "truncate": True}, timeout=60)
    # NOTE: the shared runner's prefix cache may already hold the template's blocks.
    assert ok.status_code == 200 and 0 < int(ok.headers["x-compute-tokens"]) <= 150


@pytest.mark.parametrize("path,body,status", [
    ("/rerank", {"query": QUERY, "texts": []}, 400),
    ("/rerank", {"query": "", "texts": ["a"]}, 400),
    ("/rerank", {"query": QUERY, "texts": ["a"] * 9}, 422),
    ("/rerank", {"query": QUERY, "texts": "a"}, 422),
    ("/rerank", {"query": 3, "texts": ["a"]}, 422),
    ("/rerank", {"texts": ["a"]}, 422),
    ("/rerank", {"query": QUERY, "texts": ["a"], "truncation_direction": "middle"}, 422),
    ("/v1/rerank", {"query": QUERY, "documents": []}, 400),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, 422),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, 422),
    ("/v1/rerank", {"query": QUERY, "documents": [{"txt": "a"}]}, 422),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"] * 9}, 422),
    ("/embed", {"inputs": "x"}, 400),
    ("/v1/embeddings", {"input": "x"}, 400),
])
def test_rerank_bad_inputs(servers, path, body, status):
    r = httpx.post(servers["compact"].url + path, json=body)
    assert r.status_code == status, r.text
    if path.startswith("/v1/"):
        assert r.json()["error"]["message"]
    else:
        assert set(r.json()) == {"error", "error_type"}


@pytest.mark.parametrize("path,body", [
    ("/rerank", {"query": "", "texts": ["a"]}),
    ("/v1/rerank", {"query": "", "documents": ["a"]}),
])
def test_empty_query_is_named(servers, path, body):
    r = httpx.post(servers["compact"].url + path, json=body)
    message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["error"]
    assert r.status_code == 400 and message == "query must not be empty", r.text


def test_info_reranker(servers):
    info = httpx.get(servers["compact"].url + "/info").json()
    assert "reranker" in info["model_type"] and info["max_client_batch_size"] == 8


def test_empty_documents_are_scored(servers, oracle):
    """An empty document is scored like TEI does: its templated input is not empty."""
    url = servers["compact"].url
    docs = ["", DOCS[0], ""]
    ref = [oracle(QUERY, d) for d in docs]
    tei = httpx.post(url + "/rerank", json={"query": QUERY, "texts": docs, "raw_scores": True}, timeout=60)
    assert tei.status_code == 200, tei.text
    assert sorted(r["index"] for r in tei.json()) == [0, 1, 2]
    for r in tei.json():
        assert abs(r["score"] - ref[r["index"]]) < 1e-4
    v1 = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": docs, "return_documents": True}, timeout=60)
    assert v1.status_code == 200, v1.text
    for r in v1.json()["results"]:
        assert abs(r["relevance_score"] - sigmoid(ref[r["index"]])) < 1e-4 and r["document"]["text"] == docs[r["index"]]
    for path, body in (("/rerank", {"query": "", "texts": [""]}), ("/v1/rerank", {"query": "", "documents": [""]}),
                       ("/v1/rerank", {"query": QUERY, "documents": []})):
        assert httpx.post(url + path, json=body).status_code == 400


def cache_hit_tokens(url: str) -> int:
    """Tokens the (shared) runner's prefix cache has served so far."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return int(float(next(ln for ln in lines if ln.startswith('radixserve_prefix_cache_tokens_total{result="hit"}'))
                     .split()[-1]))


def test_long_query_with_many_documents_costs_once(servers):
    """A ~0.9 MB query with 64 documents: the query is tokenized once, not 64 times (that took
    44 CPU-s and ~3 GB before answering 422). Limits, not timings: generous for a busy 2-core box."""
    url = servers["wide"].url
    query = "lorem ipsum dolor sit amet " * 33_000  # 891k chars
    docs = [f"document {i} about something else" for i in range(64)]

    def refused():
        return httpx.post(url + "/rerank", json={"query": query, "texts": docs}, timeout=120)

    r, cpu, growth = measure(refused)
    assert r.status_code == 422 and "query" in r.json()["error"], r.text[:300]
    assert cpu < 10 and growth < 500, (cpu, growth)

    def truncated():
        return httpx.post(url + "/v1/rerank", json={"query": query, "documents": docs, "top_n": 3}, timeout=120)

    refused_v1, cpu, growth = measure(truncated)
    assert refused_v1.status_code == 422  # /v1/rerank follows --auto-truncate (false here)
    # Truncating from the right would cut every document out (every score the same): refused.
    cut_out = httpx.post(url + "/rerank", json={"query": query, "texts": docs, "truncate": True}, timeout=120)
    assert cut_out.status_code == 422 and "maximum input length of 200" in cut_out.json()["error"], cut_out.text
    hits = cache_hit_tokens(url)
    ok, cpu, growth = measure(lambda: httpx.post(url + "/rerank", json={
        "query": query, "texts": docs, "truncate": True, "truncation_direction": "Left"}, timeout=120))
    # Every input truncated to 200 tokens; x-compute-tokens leaves out what the prefix cache served.
    computed, served = int(ok.headers["x-compute-tokens"]), cache_hit_tokens(url) - hits
    assert ok.status_code == 200 and len(ok.json()) == 64 and computed + served == 64 * 200, (computed, served)
    assert cpu < 15 and growth < 500, (cpu, growth)

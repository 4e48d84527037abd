"""Score-head routes through a real uvicorn server: TEI /predict, vLLM /classify, /score, /pooling,
/rerank on a seq-cls reranker, /info's head and routes, and the 400 naming the right route.

Oracle: transformers' *ForSequenceClassification from the same fixture, fp32, one input at a time,
on the ids our tokenizer gives (a pair: the tokenizer's own pair encoding; a rerank pair: the
Qwen3-Reranker template written out in tests/test_model_forward.py). 1e-4.
"""
from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
import torch

import fixtures
from models.runner import load_runner
from server.app import create_app
from server.config import ServerConfig
from tests.serving import ServerThread
from tests.test_model_forward import INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX

TEXTS = ["the film was wonderful", "a dull, plodding story", "it rained on tuesday"]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "berlin is the capital of germany", "pasta recipes"]
TOL = 1e-4


def _oracle(model_dir, cls_name):
    import transformers

    hf = getattr(transformers, cls_name).from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def logits(ids):
        with torch.inference_mode():
            return hf(input_ids=torch.tensor([ids])).logits[0].numpy()  # [labels]

    return logits


def _start(model_dir, runner, **kw):
    config = ServerConfig(model_id=str(model_dir), **{"max_client_batch_size": 8, **kw})
    return ServerThread(create_app(config, runner=runner)).start()


@pytest.fixture(scope="module")
def classifier(fixture_root):
    d = fixtures.cached("tiny-qwen3-seq-cls-3", root=fixture_root)
    cached = load_runner(str(d), device="cpu", dtype="float32")
    plain = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)
    servers = {"compact+cache": _start(d, cached, radix_mlp_threshold=1.0),
               "paper": _start(d, dataclasses.replace(plain, radix_attention="paper"), radix_mlp_threshold=1.0),
               "off": _start(d, plain, radix_mlp_threshold=0.0)}
    yield servers, cached.tokenizer, _oracle(d, "Qwen3ForSequenceClassification")
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def reranker(fixture_root):
    d = fixtures.cached("tiny-llama-seq-cls", root=fixture_root)
    # Llama publishes no reranker template: the operator names one (without it, a reward model)
    runner = load_runner(str(d), device="cpu", dtype="float32", rerank_template="qwen3-reranker")
    srv = _start(d, runner, radix_mlp_threshold=1.0)
    yield srv, runner.tokenizer, _oracle(d, "LlamaForSequenceClassification")
    srv.stop()


@pytest.fixture(scope="module")
def reward(fixture_root):
    d = fixtures.cached("tiny-qwen2-seq-cls", root=fixture_root)
    runner = load_runner(str(d), device="cpu", dtype="float32", kind="reward")
    srv = _start(d, runner, radix_mlp_threshold=1.0)
    yield srv, runner.tokenizer, _oracle(d, "Qwen2ForSequenceClassification")
    srv.stop()


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.parametrize("mode", ["compact+cache", "paper", "off"])
def test_predict_matches_transformers(classifier, mode):
    servers, tok, oracle = classifier
    url = servers[mode].url
    labels = ["negative", "neutral", "positive"]
    for _ in range(2):  # the second request reads the prefix cache where it is on
        batch = httpx.post(url + "/predict", json={"inputs": [[t] for t in TEXTS] + [[TEXTS[0], TEXTS[1]]]},
                           timeout=60)
        assert batch.status_code == 200, batch.text
        assert "x-compute-tokens" in batch.headers
        wants = [_softmax(oracle(tok.encode(t).ids)) for t in TEXTS] + [_softmax(oracle(tok.encode(TEXTS[0], TEXTS[1]).ids))]
        for got, want in zip(batch.json(), wants):
            assert [g["score"] for g in got] == sorted((g["score"] for g in got), reverse=True)
            assert {g["label"]: g["score"] for g in got} == pytest.approx(dict(zip(labels, want)), abs=TOL)
    one = httpx.post(url + "/predict", json={"inputs": TEXTS[2], "raw_scores": True}, timeout=60).json()
    raw = oracle(tok.encode(TEXTS[2]).ids)
    assert {g["label"]: g["score"] for g in one} == pytest.approx(dict(zip(labels, raw)), abs=TOL)
    pair = httpx.post(url + "/predict", json={"inputs": [TEXTS[0], TEXTS[1]]}, timeout=60).json()
    assert isinstance(pair[0], dict) and len(pair) == 3  # [str, str] is one pair, not a batch


def test_classify_and_dispatch(classifier):
    servers, tok, oracle = classifier
    url = servers["compact+cache"].url
    r = httpx.post(url + "/classify", json={"model": "m", "input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] == sum(len(tok.encode(t).ids) for t in TEXTS)
    labels = ["negative", "neutral", "positive"]
    for item, text in zip(body["data"], TEXTS):
        want = _softmax(oracle(tok.encode(text).ids))
        assert item["num_classes"] == 3 and item["probs"] == pytest.approx(list(want), abs=TOL)
        assert item["label"] == labels[int(np.argmax(want))]
    root = httpx.post(url + "/", json={"inputs": TEXTS[0]}, timeout=60)
    assert root.status_code == 200 and len(root.json()) == 3
    schema = httpx.get(url + "/openapi.json", timeout=60).json()
    assert {"/predict", "/classify", "/score", "/pooling"} <= set(schema["paths"])
    assert "inputs" in schema["paths"]["/"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]


def test_routes_the_head_cannot_serve_name_those_it_can(classifier, reward):
    url = classifier[0]["compact+cache"].url
    for path, body in (("/rerank", {"query": "q", "texts": ["a"]}), ("/embed", {"inputs": "a"}),
                       ("/score", {"text_1": "q", "text_2": ["a"]}), ("/pooling", {"input": "a"})):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400 and "/predict" in r.text and "/classify" in r.text, (path, r.text)
    info = httpx.get(url + "/info", timeout=60).json()
    assert info["head"] == "score" and "/predict" in info["routes"]
    assert info["model_type"] == {"classifier": {"id2label": {"0": "negative", "1": "neutral", "2": "positive"}}}
    for path, body in (("/rerank", {"query": "q", "texts": ["a"]}), ("/embed", {"inputs": "a"})):
        r = httpx.post(reward[0].url + path, json=body, timeout=60)
        assert r.status_code == 400 and "/pooling" in r.text and "/predict" in r.text, (path, r.text)


def test_seq_cls_reranker_serves_rerank_and_score(reranker):
    srv, tok, oracle = reranker

    def ids(query, doc, instruction=INSTRUCTION):
        body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
        return (tok.encode(RERANK_PREFIX, add_special_tokens=False).ids + tok.encode(body, add_special_tokens=False).ids
                + tok.encode(RERANK_SUFFIX, add_special_tokens=False).ids)

    want = np.array([oracle(ids(QUERY, d))[0] for d in DOCS])
    r = httpx.post(srv.url + "/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert {x["index"]: x["score"] for x in r.json()} == pytest.approx(dict(enumerate(want)), abs=TOL)
    s = httpx.post(srv.url + "/score", json={"model": "m", "text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert s.status_code == 200, s.text
    assert [d["score"] for d in s.json()["data"]] == pytest.approx(list(_sigmoid(want)), abs=TOL)
    assert [d["index"] for d in s.json()["data"]] == [0, 1, 2]
    other = "who wrote hamlet"
    zipped = httpx.post(srv.url + "/v1/score", json={"text_1": [QUERY, other], "text_2": DOCS[:2],
                                                     "use_activation": False}, timeout=60).json()
    want2 = [oracle(ids(QUERY, DOCS[0]))[0], oracle(ids(other, DOCS[1]))[0]]
    assert [d["score"] for d in zipped["data"]] == pytest.approx(want2, abs=TOL)
    bad = httpx.post(srv.url + "/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, timeout=60)
    assert 400 <= bad.status_code < 500 and "text_1" in bad.text
    info = httpx.get(srv.url + "/info", timeout=60).json()
    assert info["head"] == "score" and "/score" in info["routes"] and "reranker" in info["model_type"]


def test_reward_pooling(reward):
    srv, tok, oracle = reward
    r = httpx.post(srv.url + "/pooling", json={"input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    for item, text in zip(r.json()["data"], TEXTS):
        assert item["object"] == "pooling" and item["data"] == pytest.approx(list(oracle(tok.encode(text).ids)), abs=TOL)


@pytest.mark.parametrize("path,body,status", [
    ("/predict", {"inputs": []}, 400),
    ("/predict", {"inputs": ""}, 400),
    ("/predict", {"inputs": ["a", "b", "c"]}, 422),  # neither one text nor a pair
    ("/predict", {"inputs": [["a", "b", "c"]]}, 422),
    ("/predict", {"inputs": [["x"]] * 9}, 422),  # over max_client_batch_size (8)
    ("/predict", {"inputs": 5}, 422),
    ("/predict", {"inputs": "word " * 20000, "truncate": False}, 422),  # over max_input_length
    ("/classify", {"input": ["a"] * 9}, 422),
    ("/classify", {"input": "a", "truncate_prompt_tokens": 0}, 422),
    ("/classify", {"input": "a", "truncate_prompt_tokens": -2}, 422),
])
def test_bad_classification_bodies(classifier, path, body, status):
    r = httpx.post(classifier[0]["off"].url + path, json=body, timeout=60)
    assert r.status_code == status, r.text


def test_truncation_keeps_the_answer_exact(classifier):
    servers, tok, oracle = classifier
    text = "word " * 5000
    r = httpx.post(servers["off"].url + "/classify", json={"input": text, "truncate_prompt_tokens": 16}, timeout=60)
    assert r.status_code == 200, r.text
    ids = tok.encode(text).ids[-16:]  # vLLM keeps the last n tokens
    assert r.json()["data"][0]["probs"] == pytest.approx(list(_softmax(oracle(ids))), abs=TOL)


def test_bad_score_bodies(reranker):
    srv = reranker[0]
    assert httpx.post(srv.url + "/score", json={"text_1": "q", "text_2": ["d"] * 9}, timeout=60).status_code == 422
    assert httpx.post(srv.url + "/score", json={"text_1": "", "text_2": ["d"]}, timeout=60).status_code == 400
    assert httpx.post(srv.url + "/score", json={"text_1": "q"}, timeout=60).status_code == 422


def _truncate_minimum(url: str, path: str) -> int:
    body = httpx.get(url + "/openapi.json", timeout=60).json()["paths"][path]["post"]["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    branches = schema["properties"]["truncate_prompt_tokens"]["anyOf"]
    (counted,) = [b for b in branches if b.get("type") == "integer" and "enum" not in b]
    return counted["minimum"]


@pytest.mark.parametrize("which,path", [("classifier", "/classify"), ("reward", "/pooling")])
def test_truncate_prompt_tokens_schema_equals_what_the_route_accepts(classifier, reward, which, path):
    """The schema's minimum is the smallest n the route answers (the tokenizer's special tokens
    plus one of the text); one less is refused, as the schema says."""
    url = classifier[0]["off"].url if which == "classifier" else reward[0].url
    tok = classifier[1] if which == "classifier" else reward[1]
    least = _truncate_minimum(url, path)
    assert least == tok.num_special_tokens_to_add(False) + 1
    ok = httpx.post(url + path, json={"input": "word " * 50, "truncate_prompt_tokens": least}, timeout=60)
    assert ok.status_code == 200, ok.text
    if least > 1:
        r = httpx.post(url + path, json={"input": "word " * 50, "truncate_prompt_tokens": least - 1}, timeout=60)
        assert r.status_code == 422, r.text

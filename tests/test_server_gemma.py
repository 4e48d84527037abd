"""Gemma2 embeddings (/embed, /v1/embeddings) and Gemma yes/no rerankers (/rerank, bge-reranker-v2-gemma's layout) over HTTP,
with the prefix cache on, against transformers' Gemma2Model and GemmaForCausalLM (fp32, 1e-4).

The inputs are longer than the Gemma2 fixture's window (8), and the reranker's template alone is.
"""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

import fixtures
from models.runner import load_runner
from server.app import create_app
from server.config import ServerConfig
from tests.serving import ServerThread
from tests.test_bge_reranker_gemma import flag_inputs, yes_loc

TEXTS = ["the quick brown fox jumps over the lazy dog near the river bank", "a short one"]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "berlin is the capital of germany"]


def _serve(d):
    runner = load_runner(str(d), device="cpu", dtype="float32")
    return runner, ServerThread(create_app(ServerConfig(model_id=str(d), radix_mlp_threshold=1.0),
                                           runner=runner)).start()


def test_gemma2_embeddings_over_http(fixture_root):
    import transformers

    d = fixtures.cached("tiny-gemma2", kind="embedding", root=fixture_root)
    runner, srv = _serve(d)
    try:
        hf = transformers.Gemma2Model.from_pretrained(str(d), dtype=torch.float32).eval()
        with torch.inference_mode():
            want = np.stack([hf(input_ids=torch.tensor([runner.tokenizer.encode(t).ids])).last_hidden_state[0, -1]
                             .numpy() for t in TEXTS])
        want /= np.linalg.norm(want, axis=1, keepdims=True)
        for _ in range(2):  # the second request reads the prefix cache
            got = np.asarray(httpx.post(srv.url + "/embed", json={"inputs": TEXTS}, timeout=60).json())
            assert np.abs(got - want).max() < 1e-4
        oai = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS, "model": str(d)}, timeout=60).json()
        assert np.abs(np.asarray([x["embedding"] for x in oai["data"]]) - want).max() < 1e-4
        info = httpx.get(srv.url + "/info", timeout=60).json()
        assert info["attention_backend"] == "spec-varlen" and "softcap" in info["attention_backend_rejected"]["sdpa"]
    finally:
        srv.stop()


@pytest.mark.parametrize("preset", ["tiny-gemma", "tiny-gemma2"])
def test_gemma_yes_no_reranker_over_http(fixture_root, preset):
    import transformers

    d = fixtures.cached(preset, kind="reranker", root=fixture_root)
    runner, srv = _serve(d)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()

        def score(doc):  # bge-reranker-v2-gemma's layout and score (the "Yes" logit alone)
            (ids,) = flag_inputs(d, QUERY, [doc])
            with torch.inference_mode():
                logits = hf(input_ids=torch.tensor([ids])).logits[0, -1]  # soft-capped by Gemma2ForCausalLM
            return float(logits[yes_loc(d)])

        want = {i: score(doc) for i, doc in enumerate(DOCS)}
        r = httpx.post(srv.url + "/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert {x["index"]: x["score"] for x in r.json()} == pytest.approx(want, abs=1e-4)
    finally:
        srv.stop()

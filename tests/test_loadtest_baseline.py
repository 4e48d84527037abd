"""The transformers peer baseline: padding/pooling invariants and its HTTP routes, checked against
transformers run on each sequence alone (no padding, no batching)."""
from __future__ import annotations

import math

import pytest
import torch
import transformers
from fastapi.testclient import TestClient

from loadtest.baseline import BaselineConfig, create_app
from loadtest.baseline_model import BaselineModel, detect_kind, last_token, pad_batch


def test_pad_batch_and_last_token_by_hand():
    ids, mask, pos = pad_batch([[5, 6, 7], [8]], pad_id=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]] and pos.tolist() == [[0, 1, 2], [0, 0, 0]]
    ids, mask, pos = pad_batch([[5, 6, 7], [8]], pad_id=0, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and pos.tolist() == [[0, 1, 2], [0, 0, 0]]
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)  # [B, T, E]
    assert last_token(hidden, mask).tolist() == [hidden[0, 2].tolist(), hidden[1, 0].tolist()]


@pytest.fixture(scope="module")
def emb(tiny_embedding_dir):
    return BaselineModel(str(tiny_embedding_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def rer(tiny_reranker_dir):
    return BaselineModel(str(tiny_reranker_dir), device="cpu", dtype="float32")


def _alone_embedding(model_dir, seq):
    m = transformers.AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        h = m(input_ids=torch.tensor([seq])).last_hidden_state[0, -1]  # [E]
    return torch.nn.functional.normalize(h, dim=-1)


def test_kinds(emb, rer, tiny_embedding_dir, tiny_reranker_dir):
    assert detect_kind(tiny_embedding_dir) == "embedding" and emb.kind == "embedding"
    assert detect_kind(tiny_reranker_dir) == "reranker" and rer.kind == "reranker"


def test_padding_sides_equal_unpadded(emb, rer, tiny_embedding_dir, tiny_reranker_dir):
    texts = ["short", "a considerably longer input text with quite a few more words in it", "mid length text"]
    seqs = emb.encode_texts(texts)
    assert len({len(s) for s in seqs}) == 3
    left, right = emb.forward(seqs, side="left"), emb.forward(seqs, side="right")
    alone = torch.stack([_alone_embedding(tiny_embedding_dir, s) for s in seqs])  # [B, E]
    assert left.shape == (3, emb.model.config.hidden_size)
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=0)

    pairs = rer.encode_pairs("what is a cat", ["a cat is an animal", "no", "cats are small furry pets people keep"])
    lm = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_reranker_dir), dtype=torch.float32).eval()
    yes, no = rer.yes_no
    with torch.inference_mode():
        ref = torch.stack([lm(input_ids=torch.tensor([s])).logits[0, -1] for s in pairs])  # [B, V]
    ref = ref[:, yes] - ref[:, no]
    for side in ("left", "right"):
        torch.testing.assert_close(rer.forward(pairs, side=side), ref, atol=1e-4, rtol=1e-5)


def test_http_routes(emb, rer, tiny_embedding_dir):
    texts = ["first text", "the second, longer text of this request", "third"]
    app = create_app(BaselineConfig(model_id=str(tiny_embedding_dir), batch_wait_ms=2.0), model=emb)
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/embeddings", json={"input": texts, "model": "m"})
        assert r.status_code == 200
        data = r.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2]
        ref = emb.forward(emb.encode_texts(texts))
        for d, want in zip(data, ref):
            assert len(d["embedding"]) == emb.model.config.hidden_size
            assert torch.allclose(torch.tensor(d["embedding"]), want, atol=1e-5)
        assert r.json()["usage"]["prompt_tokens"] == sum(len(s) for s in emb.encode_texts(texts))
        one = c.post("/embed", json={"inputs": texts[1]}).json()
        assert torch.allclose(torch.tensor(one[0]), ref[1], atol=1e-5)
        assert c.post("/v1/embeddings", json={"input": []}).status_code == 422
        assert c.post("/rerank", json={"query": "q", "texts": ["a"]}).status_code == 400  # wrong kind
        metrics = c.get("/metrics").text
        assert 'radixserve_tokens_total{kind="original"}' in metrics

    docs = ["a cat is an animal", "stock prices fell", "cats are small furry pets", "x"]
    app = create_app(BaselineConfig(model_id="unused", batch_wait_ms=2.0), model=rer)
    with TestClient(app) as c:
        got = c.post("/rerank", json={"query": "what is a cat", "texts": docs}).json()
        raw = rer.forward(rer.encode_pairs("what is a cat", docs)).tolist()
        want = sorted(range(len(docs)), key=lambda i: -raw[i])
        assert [g["index"] for g in got] == want
        for g in got:
            assert g["score"] == pytest.approx(1 / (1 + math.exp(-raw[g["index"]])), abs=1e-5)
        scores = [g["score"] for g in got]
        assert scores == sorted(scores, reverse=True)
        rawr = c.post("/rerank", json={"query": "what is a cat", "texts": docs, "raw_scores": True}).json()
        assert {g["index"]: g["score"] for g in rawr}[0] == pytest.approx(raw[0], abs=1e-4)


def test_dynamic_batching_groups_concurrent_requests(emb, tiny_embedding_dir):
    """Concurrent requests share forwards (fewer forwards than requests) and each gets its own rows."""
    import asyncio

    import httpx

    calls = []
    orig = emb.forward

    def counting(seqs, *, side="left"):
        calls.append(len(seqs))
        return orig(seqs, side=side)

    emb.forward = counting
    try:
        app = create_app(BaselineConfig(model_id="unused", batch_wait_ms=50.0, max_batch_items=64), model=emb)
        texts = [[f"request {i} text {j}" for j in range(3)] for i in range(6)]

        async def go():
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                    return await asyncio.gather(*(c.post("/v1/embeddings", json={"input": t}) for t in texts))

        resps = asyncio.run(go())
    finally:
        emb.forward = orig
    assert sum(calls) == 18 and len(calls) < 6
    for t, r in zip(texts, resps):
        want = orig(emb.encode_texts(t))
        got = torch.tensor([d["embedding"] for d in r.json()["data"]])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

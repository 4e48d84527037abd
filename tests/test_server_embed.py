"""Embedding routes through a real uvicorn server, the real Scheduler and a tiny fixture model.

Oracle: transformers' AutoModel from the same fixture directory, fp32, one sequence at a time
(last-token pooling, then truncation and L2 normalization done here with numpy).
"""
from __future__ import annotations

import asyncio
import dataclasses

import httpx
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from server.app import create_app
from server.config import ServerConfig
from tests.serving import ServerThread, cached_runner

TEXTS = [
    "what is the capital of france",
    "what is the capital of germany",
    "what is the capital of france and why is it paris",
    "paris is the capital and most populous city of france",
    "paris is the capital and most populous city of france, with 2.1 million residents",
    "berlin is the capital of germany",
    "a completely unrelated sentence about cooking pasta",
    "what is",
]


@pytest.fixture(scope="module")
def runner(tiny_embedding_dir):
    return cached_runner(str(tiny_embedding_dir))


@pytest.fixture(scope="module")
def tok(runner) -> Tokenizer:
    return runner.tokenizer


@pytest.fixture(scope="module")
def oracle(tiny_embedding_dir):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(tiny_embedding_dir), dtype=torch.float32).eval()

    def embed(ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids])).last_hidden_state  # [1, T, E]
        return out[0, -1].numpy()

    return embed


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _start(runner, tiny_embedding_dir, **overrides) -> ServerThread:
    config = ServerConfig(model_id=str(tiny_embedding_dir), **overrides)
    return ServerThread(create_app(config, runner=runner)).start()


@pytest.fixture(scope="module")
def servers(runner, tiny_embedding_dir):
    paper = dataclasses.replace(runner, radix_attention="paper")
    started = {
        "compact": _start(runner, tiny_embedding_dir, radix_mlp_threshold=1.0, max_client_batch_size=16,
                          allow_token_ids=True),
        "paper": _start(paper, tiny_embedding_dir, radix_mlp_threshold=1.0),
        "off": _start(runner, tiny_embedding_dir, radix_mlp_threshold=0.0),
    }
    yield started
    for srv in started.values():
        srv.stop()


@pytest.fixture(scope="module")
def srv(servers) -> ServerThread:
    return servers["compact"]


@pytest.mark.parametrize("mode", ["compact", "paper", "off"])
def test_embed_matches_transformers(servers, tok, oracle, mode):
    prompt = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
    url = servers[mode].url
    queries = httpx.post(url + "/embed", json={"inputs": TEXTS, "prompt_name": "query"}, timeout=60)
    docs = httpx.post(url + "/embed", json={"inputs": TEXTS}, timeout=60)
    raw = httpx.post(url + "/embed", json={"inputs": TEXTS, "normalize": False, "dimensions": 16}, timeout=60)
    for r in (queries, docs, raw):
        assert r.status_code == 200, r.text
        for h in ("x-queue-time", "x-inference-time", "x-total-time", "x-compute-tokens"):
            assert int(r.headers[h]) >= 0
    for i, text in enumerate(TEXTS):
        q_ref = oracle(tok.encode(prompt + text).ids)
        d_ref = oracle(tok.encode(text).ids)
        np.testing.assert_allclose(queries.json()[i], _unit(q_ref), atol=1e-4, rtol=0)
        np.testing.assert_allclose(docs.json()[i], _unit(d_ref), atol=1e-4, rtol=0)
        np.testing.assert_allclose(raw.json()[i], d_ref[:16], atol=1e-4, rtol=0)
    # NOTE: at most the tokens sent: the shared runner's prefix cache may hold some of them already.
    assert 0 < int(docs.headers["x-compute-tokens"]) <= sum(len(tok.encode(t).ids) for t in TEXTS)


def test_openai_sdk(srv, tok, oracle):
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    name = str(srv_model_id(srv))
    one = client.embeddings.create(model=name, input=TEXTS[0])  # SDK asks for base64
    assert one.object == "list" and one.model == name and len(one.data) == 1
    np.testing.assert_allclose(one.data[0].embedding, _unit(oracle(tok.encode(TEXTS[0]).ids)), atol=1e-4, rtol=0)
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(tok.encode(TEXTS[0]).ids)
    many = client.embeddings.create(model=name, input=TEXTS[:3], dimensions=8)
    assert [d.index for d in many.data] == [0, 1, 2]
    for d, text in zip(many.data, TEXTS[:3]):
        np.testing.assert_allclose(d.embedding, _unit(oracle(tok.encode(text).ids)[:8]), atol=1e-4, rtol=0)
    floats = client.embeddings.create(model=name, input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, _unit(oracle(tok.encode(TEXTS[1]).ids)), atol=1e-4, rtol=0)


def srv_model_id(srv: ServerThread) -> str:
    return httpx.get(srv.url + "/info").json()["model_id"]


def test_token_id_inputs_and_alias(srv, tok, oracle):
    ids = [tok.encode(t).ids for t in TEXTS[:2]]
    for path, body in (("/v1/embeddings", {"input": ids}), ("/embeddings", {"input": ids[0]})):
        r = httpx.post(srv.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        for d, seq in zip(r.json()["data"], ids):
            np.testing.assert_allclose(d["embedding"], _unit(oracle(seq)), atol=1e-4, rtol=0)


def test_tokenize_offsets(srv, tok):
    text = "hello wörld 🙂"
    r = httpx.post(srv.url + "/tokenize", json={"inputs": [text]})
    assert r.status_code == 200, r.text
    (tokens,) = r.json()
    assert [t["id"] for t in tokens] == tok.encode(text).ids
    assert tokens[-1]["special"] and tokens[-1]["text"] == "<|endoftext|>"
    assert "".join(t["text"] for t in tokens if not t["special"]).startswith("hello w")
    assert all(text[t["start"]:t["stop"]] == t["text"] for t in tokens[:2])
    bare = httpx.post(srv.url + "/tokenize", json={"inputs": text, "add_special_tokens": False}).json()[0]
    assert [t["id"] for t in bare] == tok.encode(text, add_special_tokens=False).ids
    prompted = httpx.post(srv.url + "/tokenize", json={"inputs": "x", "prompt_name": "query"}).json()[0]
    assert prompted[0]["text"] == "In" and prompted[0]["start"] == 0


def test_info_health_docs(srv):
    info = httpx.get(srv.url + "/info").json()
    assert info["model_type"] == {"embedding": {"pooling": "last-token"}}
    assert info["radix_mlp_threshold"] == 1.0 and info["radix_attention"] == "compact"
    assert info["max_input_length"] == min(32768, info["max_batch_tokens"])
    # Every field the app builds reaches the client (the response model must not filter any out).
    app = srv.server.config.app
    assert info["batching_policy"] == app.state.config.batching_policy
    assert info["attention_backend"] == "sdpa"  # CPU; the others say why they are not used
    assert "needs CUDA" in info["attention_backend_rejected"]["flash-attn"]
    assert info["linear"] == "onednn-packed"  # CPU float32: weights packed at load
    # the CPU's attention kernel, as measured at load: tiles or the flash kernel, with the figure
    assert info["cpu_attention"].startswith(("onednn-tiles for large blocks (", "flash (oneDNN tiles ran"))
    assert set(info) == set(app.state.info)
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/docs").status_code == 200
    assert "/v1/embeddings" in httpx.get(srv.url + "/openapi.json").json()["paths"]


def test_concurrent_clients(srv):
    """200 requests of 8 items from 32 concurrent clients, each equal to the items alone."""
    alone = np.array(httpx.post(srv.url + "/embed", json={"inputs": TEXTS}, timeout=60).json())
    rng = np.random.default_rng(0)
    plans = [rng.integers(0, len(TEXTS), size=8).tolist() for _ in range(200)]

    async def main():
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=32)) as c:
            async def one(plan):
                async with sem:
                    r = await c.post("/embed", json={"inputs": [TEXTS[i] for i in plan]})
                return plan, r

            return await asyncio.gather(*(one(p) for p in plans))

    for plan, r in asyncio.run(main()):
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.array(r.json()), alone[plan], atol=1e-4, rtol=0)

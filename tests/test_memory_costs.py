"""Each route's memory estimate (server/memory.py: bytes per token by route, 32 per answer float)
covers what the process really holds while serving its request: the peak RSS growth of a large
request on a warm server (tests/limits.measure: Rust and C allocations included) stays within the
estimate plus the headroom the budget always keeps out (server/memory.py ``headroom``: at least a
full batch's activations on the host and the allocator's slack).

Token counts are the server's usage where the dialect reports it; /predict pairs are counted with
the tokenizer's own whole-pair encode, cut to the input limit.
"""
from __future__ import annotations

import httpx
import pytest

import fixtures
from server.app import host_activations
from server.config import ServerConfig
from server.memory import FLOAT_BYTES, TOKEN_BYTES_BY_COST, headroom
from tests.limits import measure
from tests.serving import serve

pytestmark = pytest.mark.slow

W = "lorem ipsum dolor sit amet "
MAX_INPUT = 1024


def _text(i: int, words: int) -> str:
    return f"{i} " + W * words  # distinct: no prefix shared past the first token


def _kept_out(model_dir: str) -> int:
    """The headroom the server's budget keeps out for this model at the smallest limit (its floor)."""
    from tests.serving import cached_runner

    config = ServerConfig(model_id=model_dir)  # the budget of `serve`'s server
    return headroom(0, activations=host_activations(config, cached_runner(model_dir)))


def _check(url: str, path: str, body: dict, small: dict, tokens_of, *, cost: str, floats_of, kept: int) -> None:
    assert httpx.post(url + path, json=small, timeout=600).status_code == 200  # the route warm, not its size
    r, _cpu, peak_mb = measure(lambda: httpx.post(url + path, json=body, timeout=900))
    assert r.status_code == 200, r.text[:300]
    tokens = tokens_of(r)
    estimate = tokens * TOKEN_BYTES_BY_COST[cost] + floats_of(r, tokens) * FLOAT_BYTES
    assert peak_mb * 2**20 <= estimate + kept, (path, tokens, peak_mb, estimate / 2**20, kept / 2**20)


def test_embedding_routes(fixture_root):
    model_dir = str(fixtures.cached("tiny-embedding", root=fixture_root))
    srv, kept = serve(model_dir, max_client_batch_size=2048, max_input_length=MAX_INPUT), _kept_out(model_dir)
    try:
        body = {"input": [_text(i, 30) for i in range(512)]}
        _check(srv.url, "/v1/embeddings", body, {"input": ["a", "b"]},
               lambda r: r.json()["usage"]["prompt_tokens"], cost="embed",
               floats_of=lambda r, t: len(r.json()["data"]) * len(r.json()["data"][0]["embedding"]), kept=kept)
        body = {"inputs": [_text(i, 30) for i in range(12)], "truncate": True}
        _check(srv.url, "/embed_all", body, {"inputs": ["a"]}, lambda r: sum(map(len, r.json())), cost="embed_all",
               floats_of=lambda r, t: t * len(r.json()[0][0]), kept=kept)
    finally:
        srv.stop()


def test_rerank_and_score_routes(fixture_root):
    model_dir = str(fixtures.cached("tiny-reranker", root=fixture_root))
    srv, kept = serve(model_dir, max_client_batch_size=2048, max_input_length=MAX_INPUT), _kept_out(model_dir)
    try:
        docs = [_text(i, 30) for i in range(256)]
        _check(srv.url, "/v1/rerank", {"query": "what is it", "documents": docs, "model": "m"},
               {"query": "q", "documents": ["a"], "model": "m"}, lambda r: r.json()["usage"]["total_tokens"],
               cost="rerank", floats_of=lambda r, t: len(docs), kept=kept)
        _check(srv.url, "/score", {"text_1": [f"q{i} " + W for i in range(256)], "text_2": docs},
               {"text_1": ["q", "r"], "text_2": ["a", "b"]}, lambda r: r.json()["usage"]["prompt_tokens"],
               cost="score", floats_of=lambda r, t: len(docs), kept=kept)
    finally:
        srv.stop()


def test_predict_pairs(fixture_root):
    from tests.serving import cached_runner

    model_dir = str(fixtures.cached("tiny-qwen3-seq-cls-3", root=fixture_root))
    srv, kept = serve(model_dir, max_client_batch_size=2048, max_input_length=MAX_INPUT), _kept_out(model_dir)
    tok = cached_runner(model_dir).tokenizer
    pairs = [[_text(i, 15), _text(-i, 15)] for i in range(256)]
    try:
        _check(srv.url, "/predict", {"inputs": pairs, "truncate": True}, {"inputs": [["a", "b"]]},
               lambda r: sum(min(len(tok.encode(a, b).ids), MAX_INPUT) for a, b in pairs), cost="pairs",
               floats_of=lambda r, t: len(pairs) * 3, kept=kept)
    finally:
        srv.stop()

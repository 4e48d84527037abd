"""One budget per request, whatever its shape: generated bodies across the rerank and score routes
(one query for many documents, or vLLM /score's list of distinct text_1, one per text_2) and
/embed_all are admitted only when an independent count of their tokens is within the documented
limit (--max-rerank-pair-tokens; --max-batch-tokens for /embed_all), and an admitted request
reports exactly that count.

The oracle counts each pair on its own with the reference recipe (tests/test_server_pair_budget.py:
prefix + body + suffix, each pair encoded whole and cut to the input limit), never through the
server's shared-query encoder; /embed_all's tokens are the tokenizer's own encode, cut.
"""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving import cached_runner, serve
from tests.test_server_pair_budget import reference_pair_tokens

MAX_INPUT = 128
PAIR_LIMIT = 900
DISPLAY_LIMIT = 120
FLAG = "--max-rerank-pair-tokens"

_WORDS = st.sampled_from(["paris", "france", "capital", "berlin", "of", "the", "1234", "🙂", "é", "x" * 30, "  "])
_TEXT = st.lists(_WORDS, min_size=1, max_size=20).map(" ".join)


@pytest.fixture(scope="module")
def reranker(tiny_reranker_dir):
    srv = serve(tiny_reranker_dir, max_input_length=MAX_INPUT, auto_truncate=True, max_rerank_pair_tokens=PAIR_LIMIT,
                max_client_batch_size=16, radix_mlp_threshold=1.0)
    yield srv, cached_runner(str(tiny_reranker_dir)).tokenizer
    srv.stop()


@pytest.fixture(scope="module")
def embedder(tiny_embedding_dir):
    srv = serve(tiny_embedding_dir, max_input_length=MAX_INPUT, auto_truncate=True, max_batch_tokens=DISPLAY_LIMIT,
                max_client_batch_size=16, radix_mlp_threshold=1.0)
    yield srv, cached_runner(str(tiny_embedding_dir)).tokenizer
    srv.stop()


@st.composite
def rerank_bodies(draw):
    docs = draw(st.lists(_TEXT, min_size=1, max_size=12))
    route = draw(st.sampled_from(["/score", "/v1/score", "/v1/rerank", "/rerank"]))
    if route.endswith("/score") and draw(st.booleans()):
        queries = draw(st.lists(_TEXT, min_size=len(docs), max_size=len(docs)))  # one text_1 per text_2
    else:
        queries = [draw(_TEXT)] * len(docs)
    if route.endswith("/score"):
        body = {"text_1": queries if len(set(queries)) > 1 or draw(st.booleans()) else queries[0], "text_2": docs}
        if isinstance(body["text_1"], list) and len(body["text_1"]) != len(docs):
            body["text_1"] = queries
    elif route == "/v1/rerank":
        body = {"query": queries[0], "documents": docs, "model": "m"}
    else:
        body = {"query": queries[0], "texts": docs, "raw_scores": True}
    return route, body, list(zip(queries, docs))


def _reported(route: str, answer) -> int | None:
    if route.endswith("/score"):
        return answer["usage"]["prompt_tokens"]
    if route == "/v1/rerank":
        return answer["usage"]["total_tokens"]
    return None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=rerank_bodies())
def test_nothing_over_the_pair_budget_is_admitted(reranker, case):
    srv, tok = reranker
    route, body, pairs = case
    want = sum(reference_pair_tokens(tok, q, [d], MAX_INPUT) for q, d in pairs)
    r = httpx.post(srv.url + route, json=body, timeout=120)
    if r.status_code == 422 and "query and instruction alone" in r.text:
        return  # a query that leaves no room for any document is refused before the budget is counted
    if want > PAIR_LIMIT:
        assert r.status_code == 422 and FLAG in r.text, (want, r.status_code, r.text)
    else:
        assert r.status_code == 200, (want, r.text)
        got = _reported(route, r.json())
        assert got is None or got == want


def test_distinct_text_1_share_one_budget(reranker):
    """The case that bypassed the budget: every pair under it, their sum over it."""
    srv, tok = reranker
    docs = ["paris is the capital of france " * 6] * 12
    queries = [f"query number {i}" for i in range(12)]
    want = sum(reference_pair_tokens(tok, q, [d], MAX_INPUT) for q, d in zip(queries, docs))
    assert want > PAIR_LIMIT and all(reference_pair_tokens(tok, q, [d], MAX_INPUT) < PAIR_LIMIT
                                     for q, d in zip(queries, docs))
    for route in ("/score", "/v1/score"):
        r = httpx.post(srv.url + route, json={"text_1": queries, "text_2": docs}, timeout=120)
        assert r.status_code == 422 and FLAG in r.text, r.text


@st.composite
def embed_all_bodies(draw):
    return draw(st.lists(_TEXT, min_size=1, max_size=8))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=embed_all_bodies())
def test_nothing_over_the_embed_all_cap_is_admitted(embedder, texts):
    srv, tok = embedder
    want = sum(min(len(tok.encode(t).ids), MAX_INPUT) for t in texts)
    r = httpx.post(srv.url + "/embed_all", json={"inputs": texts, "truncate": True}, timeout=120)
    if want > DISPLAY_LIMIT:
        assert r.status_code == 422, (want, r.text)
    else:
        assert r.status_code == 200, (want, r.text)
        assert sum(len(rows) for rows in r.json()) == want

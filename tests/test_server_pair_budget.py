"""--max-rerank-pair-tokens, and /info's tree_attention, through a real uvicorn server on the tiny reranker.

The budget is set from an independent count of the request's pairs (each pair encoded on its own
with the reference recipe: prefix + body + suffix, the body cut to the input limit), so a request
exactly at the budget answers 200 with the unlimited server's scores, one token less answers 422
on every rerank dialect, and the tokens the server reports having built equal that count.
"""
from __future__ import annotations

import httpx
import pytest

from models.text import prompts
from tests.serving import cached_runner, serve

QUERY = "what is the capital of france"
DOCS = [
    "paris is the capital and most populous city of france",
    "berlin is the capital of germany " * 12,  # cut to the input limit
    "paris",
    "",
]
MAX_INPUT = 120
FLAG = "--max-rerank-pair-tokens"


def reference_pair_tokens(tokenizer, query: str, docs: list[str], max_length: int) -> int:
    """Tokens of the pairs, each encoded whole (no shared part) and cut to ``max_length``."""
    def enc(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    overhead = enc(prompts.RERANK_PREFIX) + enc(prompts.RERANK_SUFFIX)
    bodies = [enc(prompts.format_rerank_body(prompts.DEFAULT_INSTRUCTION, query, d)) for d in docs]
    return sum(min(overhead + b, max_length) for b in bodies)


@pytest.fixture(scope="module")
def total(tiny_reranker_dir):
    tokenizer = cached_runner(str(tiny_reranker_dir)).tokenizer
    n = reference_pair_tokens(tokenizer, QUERY, DOCS, MAX_INPUT)
    whole = reference_pair_tokens(tokenizer, QUERY, DOCS, 10**6)
    assert n < whole, "one document must be cut, so the budget is seen to count the cut pairs"
    return n


@pytest.fixture(scope="module")
def servers(tiny_reranker_dir, total):
    common = {"max_input_length": MAX_INPUT, "auto_truncate": True, "radix_mlp_threshold": 1.0}
    started = {
        "free": serve(tiny_reranker_dir, max_rerank_pair_tokens=0, **common),
        "exact": serve(tiny_reranker_dir, max_rerank_pair_tokens=total, **common),
        "under": serve(tiny_reranker_dir, max_rerank_pair_tokens=total - 1, **common),
    }
    yield started
    for s in started.values():
        s.stop()


DIALECTS = [
    ("/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True}),
    ("/rerank", {"query": QUERY, "documents": DOCS}),
    ("/", {"query": QUERY, "texts": DOCS}),
    ("/", {"query": QUERY, "documents": DOCS}),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "model": "m"}),
    ("/v2/rerank", {"query": QUERY, "documents": DOCS, "model": "m"}),
    ("/infinity/rerank", {"query": QUERY, "documents": DOCS, "raw_scores": True}),
]


def scores(path: str, answer) -> dict[int, float]:
    if path in ("/rerank", "/") and isinstance(answer, list):
        return {x["index"]: x["score"] for x in answer}
    return {x["index"]: x["relevance_score"] for x in answer["results"]}


@pytest.mark.parametrize("path,body", DIALECTS)
def test_over_the_budget_is_422_naming_the_flag(servers, total, path, body):
    r = httpx.post(servers["under"].url + path, json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert FLAG in r.text and f"{total} tokens" in r.text and f"limit of {total - 1}" in r.text


@pytest.mark.parametrize("path,body", DIALECTS)
def test_at_the_budget_answers_as_without_one(servers, path, body):
    got = httpx.post(servers["exact"].url + path, json=body, timeout=60)
    free = httpx.post(servers["free"].url + path, json=body, timeout=60)
    assert got.status_code == free.status_code == 200, (got.text, free.text)
    a, b = scores(path, got.json()), scores(path, free.json())
    assert sorted(a) == sorted(b) == list(range(len(DOCS)))
    assert all(abs(a[i] - b[i]) < 1e-5 for i in a), (a, b)


def test_the_budget_counts_the_tokens_the_server_builds(servers, total):
    """The server's own count of the tokens it sent to the model equals the budget's count."""
    r = httpx.post(servers["exact"].url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == total


@pytest.mark.parametrize("docs", [DOCS[:1], DOCS[2:], ["x " * 500, "y"]])
def test_a_smaller_request_passes_a_tight_budget(servers, tiny_reranker_dir, total, docs):
    tokenizer = cached_runner(str(tiny_reranker_dir)).tokenizer
    n = reference_pair_tokens(tokenizer, QUERY, docs, MAX_INPUT)
    assert n < total - 1
    r = httpx.post(servers["under"].url + "/v1/rerank", json={"query": QUERY, "documents": docs}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == n


def test_info_reports_tree_attention(servers, tiny_reranker_dir):
    runner = cached_runner(str(tiny_reranker_dir))
    info = httpx.get(servers["free"].url + "/info").json()
    assert info["tree_attention"] == runner.tree_report
    assert info["tree_attention"].split(" ")[0] == runner.tree_attention

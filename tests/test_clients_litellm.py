"""litellm's ``rerank()`` with each provider that targets a self-hosted rerank API, unchanged, against
a real radixserve reranker (uvicorn on loopback); scores are checked against the server's own
TEI /rerank, within the prefix cache's bound (tests/client_checks.py).

Where each provider lands: ``hosted_vllm/`` and ``infinity/`` post a ``documents`` body to /rerank
(answered in vLLM's dialect), ``jina_ai/`` to /v1/rerank, ``cohere/`` to /v2/rerank,
``huggingface/`` TEI's ``texts`` body to /rerank, and ``infinity/`` pointed at ``/infinity`` to
Infinity's own dialect (a returned document as a plain string, the only form its parser takes).
litellm comes from the ``clients`` extra; without it the module skips.
"""
from __future__ import annotations

import os

import httpx
import pytest

from tests.client_checks import assert_ranked
from tests.serving import serve

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
litellm = pytest.importorskip("litellm", reason="litellm is not installed (pip install -e '.[clients]')")

# litellm's own pydantic models warn at import about TypedDict ReadOnly items: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly` qualifier:UserWarning")

QUERY = "what is the capital of france"
DOCS = [
    "paris is the capital and most populous city of france",
    "berlin is the capital of germany",
    "a completely unrelated sentence about cooking pasta",
    "paris",
]


@pytest.fixture(scope="module")
def rr(tiny_reranker_dir):
    srv = serve(tiny_reranker_dir, served_model_name="tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def native(rr) -> dict[int, float]:
    r = httpx.post(rr.url + "/rerank", json={"query": QUERY, "texts": DOCS}, timeout=120)
    assert r.status_code == 200, r.text
    return {x["index"]: x["score"] for x in r.json()}


# (provider, path appended to the server's URL for api_base, return_documents)
CASES = [
    ("hosted_vllm", "", True),
    ("infinity", "/infinity", True),
    ("infinity", "", False),
    ("jina_ai", "", True),
    ("cohere", "", None),
    ("huggingface", "", True),
]


@pytest.mark.parametrize("provider,base,return_documents", CASES, ids=[f"{p}{b}" for p, b, _ in CASES])
def test_litellm_rerank(rr, native, provider, base, return_documents):
    kwargs = {} if return_documents is None else {"return_documents": return_documents}
    out = litellm.rerank(model=f"{provider}/tiny", query=QUERY, documents=DOCS, top_n=3,
                         api_base=rr.url + base, api_key="unused", **kwargs)
    # TEI's /rerank has no top_n (litellm's huggingface/ does not cut either): every document comes back
    assert_ranked([(r["index"], r["relevance_score"]) for r in out.results], native,
                  len(DOCS) if provider == "huggingface" else 3)
    for r in out.results:
        if return_documents:
            assert r["document"]["text"] == DOCS[r["index"]]


def test_litellm_infinity_documents_on_rerank_need_the_prefix(rr):
    """The same body on /rerank answers vLLM's {text} documents, which litellm's infinity/ parser
    refuses: the error a user meets without the ``/infinity`` base, kept visible here."""
    with pytest.raises(Exception, match="document"):
        litellm.rerank(model="infinity/tiny", query=QUERY, documents=DOCS, return_documents=True,
                       api_base=rr.url, api_key="unused")

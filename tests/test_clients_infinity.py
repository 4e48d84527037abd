"""Infinity's own client (``infinity_client`` on PyPI) against a real server, as Infinity's users
configure it: the Infinity launch line at the root (``radixserve v2 --model-id M``: Infinity's
routes at the root, as on Infinity's server), under ``--url-prefix /v1`` (base URL .../v1), and the
native line with base URL .../infinity. Rerank (scores, ``return_documents`` as a string,
``top_n``, ``raw_scores``), models (``owned_by`` "infinity", ``stats``) and embeddings, each value
compared with the same server's native TEI routes (/rerank with ``texts``, /embed).

The client pins httpx < 0.28, which this environment does not hold, so it runs in its own
virtualenv (tests/infinity_client_calls.py), built once under ~/.cache (or $INFINITY_CLIENT_VENV)
with ``python -m venv`` + ``pip install infinity_client``; the tests skip, saying why, when that
cannot be installed (no index reachable).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.client_checks import CACHE_ATOL
from tests.serving import ServerThread, cached_runner

ROOT = Path(__file__).resolve().parents[1]
CALLS = ROOT / "tests" / "infinity_client_calls.py"
QUERY = "capital of France"
DOCS = ["Paris is the capital of France.", "Berlin is in Germany.", "Cooking pasta takes ten minutes."]
# (launch line after the model, the base URL's path): how an Infinity user points the client
LINES = [(["v2"], ""), (["v2", "--url-prefix", "/v1"], "/v1"), ([], "/infinity")]


@pytest.fixture(scope="session")
def client_python() -> str:
    venv = Path(os.environ.get("INFINITY_CLIENT_VENV", Path.home() / ".cache" / "radixserve-tests" / "infinity-client"))
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import infinity_client"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return str(python)
    made = subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"could not create a virtualenv for infinity_client: {made.stderr.strip()[-300:]}")
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "infinity_client"], capture_output=True,
                         text=True, timeout=1800)
    if pip.returncode != 0 or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip(f"infinity_client could not be installed in {venv}: {pip.stderr.strip()[-300:]}")
    return str(python)


def started(model_dir, line: list[str]) -> ServerThread:
    """A real server for ``radixserve LINE --model-id DIR``: the launch line read as the CLI reads it."""
    from server.app import create_app
    from server.cli import load_config

    dialect = line[:1]
    config, _ = load_config([*dialect, "--model-id", str(model_dir), *line[1:]], environ={})
    return ServerThread(create_app(config, runner=cached_runner(str(model_dir)))).start()


def client_calls(python: str, base_url: str, kind: str) -> dict:
    out = subprocess.run([python, str(CALLS), base_url, kind, QUERY, *DOCS], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def check_models(got: dict, srv: ServerThread, capability: str) -> None:
    (model,) = got["models"]
    info = httpx.get(srv.url + "/info", timeout=120).json()
    assert model["id"] == info["served_model_name"] and model["owned_by"] == "infinity"
    assert model["capabilities"] == [capability] and model["backend"] == "torch"
    assert set(model["stats"]) == {"queue_fraction", "queue_absolute", "results_pending", "batch_size"}


@pytest.mark.parametrize("line,base", LINES, ids=["root", "url-prefix-v1", "native-infinity"])
def test_infinity_client_rerank_and_models(client_python, tiny_reranker_dir, line, base):
    srv = started(tiny_reranker_dir, line)
    try:
        got = client_calls(client_python, srv.url + base, "rerank")
        check_models(got, srv, "rerank")
        native = httpx.post(srv.url + "/rerank", json={"query": QUERY, "texts": DOCS}, timeout=300).json()
        raw = httpx.post(srv.url + "/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True},
                         timeout=300).json()
    finally:
        srv.stop()
    want = {r["index"]: r["score"] for r in native}
    want_raw = {r["index"]: r["score"] for r in raw}
    plain, documents, raw_answer = got["plain"], got["documents"], got["raw"]
    assert [r["index"] for r in plain["results"]] == [r["index"] for r in native]  # sorted as TEI sorts
    for r in plain["results"]:
        assert r["document"] is None and r["relevance_score"] == pytest.approx(want[r["index"]], abs=CACHE_ATOL)
    for r in raw_answer["results"]:
        assert r["relevance_score"] == pytest.approx(want_raw[r["index"]], abs=CACHE_ATOL)
    assert len(documents["results"]) == 2  # top_n
    for r in documents["results"]:
        assert r["document"] == DOCS[r["index"]]  # Infinity's plain string, not {"text": ...}
    assert plain["usage"]["prompt_tokens"] == plain["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("line,base", LINES, ids=["root", "url-prefix-v1", "native-infinity"])
def test_infinity_client_embeddings_and_models(client_python, tiny_embedding_dir, line, base):
    srv = started(tiny_embedding_dir, line)
    try:
        got = client_calls(client_python, srv.url + base, "embed")
        check_models(got, srv, "embed")
        want = httpx.post(srv.url + "/embed", json={"inputs": DOCS}, timeout=300).json()
    finally:
        srv.stop()
    np.testing.assert_allclose(np.asarray(got["embeddings"]), np.asarray(want), atol=CACHE_ATOL)
    assert got["usage"]["prompt_tokens"] > 0


def test_under_the_prefix_v1_the_other_dialects_keep_their_routes(tiny_reranker_dir):
    """Under Infinity's --url-prefix /v1 only /v1/rerank and /v1/models change shape; /v2/rerank,
    /v1/models/{id} and TEI's /rerank stay as they are."""
    srv = started(tiny_reranker_dir, ["v2", "--url-prefix", "/v1", "--served-model-name", "rr"])
    try:
        v1 = httpx.post(srv.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "return_documents": True},
                        timeout=300).json()
        v2 = httpx.post(srv.url + "/v2/rerank", json={"query": QUERY, "documents": DOCS}, timeout=300).json()
        tei = httpx.post(srv.url + "/rerank", json={"query": QUERY, "texts": DOCS}, timeout=300).json()
        listed = httpx.get(srv.url + "/v1/models", timeout=120).json()["data"][0]
        one = httpx.get(srv.url + "/v1/models/rr", timeout=120)
    finally:
        srv.stop()
    assert v1["object"] == "rerank" and isinstance(v1["results"][0]["document"], str)
    assert "meta" in v2 and [r["index"] for r in v2["results"]] == [r["index"] for r in tei]
    assert listed["owned_by"] == "infinity" and "stats" in listed
    assert one.status_code == 200 and one.json()["id"] == listed["id"] == "rr"

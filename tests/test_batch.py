"""``radixserve-batch`` answers each line as the HTTP server answers the same body.

Oracle: the server itself, over real HTTP (tests/serving.py), asked each line's body after the
batch job ran; the job runs the app in-process. Bodies must agree field by field (floats within
1e-4: the job batches lines together, the server gets them one at a time), statuses exactly.
"""
from __future__ import annotations

import io
import json
import sys

import httpx
import pytest

from tests.batch_util import line, read_out, run_cli, same, write_batch
from tests.serving import cached_runner, serve

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "berlin is the capital of germany", "a recipe for pasta"]


def server_answers(model_dir, rows: list, **config) -> dict:
    """custom_id -> (status, JSON body) of the HTTP server for each request row."""
    out = {}
    srv = serve(model_dir, **config)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            for row in rows:
                if isinstance(row, dict) and row.get("method") == "POST" and "custom_id" in row:
                    r = client.post(row["url"], json=row["body"])
                    out.setdefault(row["custom_id"], (r.status_code, r.json()))
    finally:
        srv.stop()
    return out


def check_against_server(model_dir, rows: list, got: list[dict], **config) -> None:
    want = server_answers(model_dir, rows, **config)
    for rec in got:
        cid = rec["custom_id"]
        if rec["error"] is not None and rec["error"].get("code") == "invalid_request_line":
            continue
        status, body = want[cid]
        assert rec["response"]["status_code"] == status, cid
        same(rec["response"]["body"], body, path=cid)
        assert (rec["error"] is None) == (status == 200), cid


def test_reranker_lines_answer_as_the_server(tmp_path, tiny_reranker_dir):
    runner = cached_runner(str(tiny_reranker_dir))
    rows = [
        line("cohere", "/v1/rerank", {"query": QUERY, "documents": DOCS, "return_documents": True}),
        line("tei", "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True}),
        line("tei-docs", "/rerank", {"query": QUERY, "documents": DOCS[:2], "top_n": 1}),
        line("v2", "/v2/rerank", {"query": "capital of germany", "documents": DOCS}),
        line("infinity", "/infinity/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}),
        "",
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/rerank", "body": {}}),  # no custom_id
        line("score", "/score", {"text_1": QUERY, "text_2": DOCS[0]}),  # no such route here: 404
        line("embeddings", "/v1/embeddings", {"input": "hello"}),  # wrong model kind: 400
        line("empty-query", "/v1/rerank", {"query": "", "documents": DOCS}),  # 400
        line("bad-type", "/rerank", {"query": QUERY, "texts": [1, 2]}),  # 422
        {"custom_id": "get", "method": "GET", "url": "/v1/rerank", "body": {}},
        line("cohere", "/v1/rerank", {"query": QUERY, "documents": DOCS}),  # repeated custom_id
    ]
    inp, out = write_batch(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert run_cli(runner, tiny_reranker_dir, inp, out) == 1  # some lines failed
    got = read_out(out)
    ids = [r["custom_id"] for r in got]
    assert ids == ["cohere", "tei", "tei-docs", "v2", "infinity", None, None, "score", "embeddings",
                   "empty-query", "bad-type", "get", "cohere"]  # one per non-blank line, input order
    bad = {r["error"]["line"]: r for r in got if r["error"] and r["error"]["code"] == "invalid_request_line"}
    assert sorted(bad) == [7, 8, 13, 14]
    assert all(r["response"]["status_code"] == 400 and r["response"]["body"] is None for r in bad.values())
    assert "repeats" in bad[14]["error"]["message"]
    assert {r["response"]["status_code"] for r in got[:5]} == {200}
    check_against_server(tiny_reranker_dir, rows, got)


def test_embedding_lines_answer_as_the_server_and_exit_zero(tmp_path, tiny_embedding_dir):
    runner = cached_runner(str(tiny_embedding_dir))
    texts = ["the cat sat on the mat", "the cat sat on the hat", "dogs bark"]
    ids = runner.tokenizer.encode("the cat sat").ids
    rows = [
        line("one", "/v1/embeddings", {"input": texts[0], "model": str(tiny_embedding_dir)}),
        line("many", "/v1/embeddings", {"input": texts, "dimensions": 8}),
        line("ids", "/v1/embeddings", {"input": ids}),
        line("tei", "/embed", {"inputs": texts, "normalize": False}),
        line("cohere", "/v2/embed", {"texts": texts, "input_type": "search_document"}),
        line("alias", "/embeddings", {"input": texts[1:]}),
    ]
    inp, out = write_batch(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    # token ids as input need --allow-token-ids, as on the server
    assert run_cli(runner, tiny_embedding_dir, inp, out, "--allow-token-ids", "true") == 0
    got = read_out(out)
    assert [r["custom_id"] for r in got] == [r["custom_id"] for r in rows]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in got)
    check_against_server(tiny_embedding_dir, rows, got, allow_token_ids=True)


def test_stdin_to_stdout(tmp_path, tiny_embedding_dir, monkeypatch):
    from server.batch.command import main

    runner = cached_runner(str(tiny_embedding_dir))
    data = b"".join(json.dumps(line(f"l{i}", "/v1/embeddings", {"input": f"text {i}"})).encode() + b"\n"
                    for i in range(3))
    stdout = io.TextIOWrapper(io.BytesIO())
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    monkeypatch.setattr(sys, "stdout", stdout)
    rc = main(["-i", "-", "-o", "-", "--model", str(tiny_embedding_dir), "--no-progress"], runner=runner)
    got = [json.loads(x) for x in stdout.buffer.getvalue().decode().splitlines()]  # type: ignore[attr-defined]
    assert rc == 0
    assert [r["custom_id"] for r in got] == ["l0", "l1", "l2"]
    assert all(r["response"]["body"]["object"] == "list" for r in got)


def test_radixserve_batch_subcommand_reaches_the_batch_parser(capsys):
    # `radixserve batch` and `radixserve run-batch` (vLLM's spelling) are the batch job's own CLI
    from server import cli

    for word in cli.BATCH_COMMANDS:
        with pytest.raises(SystemExit) as exc:
            cli.main([word, "--help"])
        assert exc.value.code == 0
        assert "--input-file" in capsys.readouterr().out

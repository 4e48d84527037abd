"""Prefix-cache workloads of the load tester: rerank-pointwise, embed-query and embed-chunks.

Request shapes, determinism in the seed, document-by-document order for embed-chunks, and
(slow tier) each workload against the real server on the tiny fixtures, where the server's own
token counter must match the tokens computed here from the request texts."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loadtest import cli, client, datasets, documents, workloads

SMALL = documents.Chunking(doc_words=(200, 300), chunk_words=(20, 40))


def _words(ds: datasets.Dataset) -> list[str]:
    return [w for s in ds.samples for p in s.passages for w in p.split()]


# ---------------------------------------------------------------- rerank-pointwise


def test_rerank_pointwise_one_pair_per_request():
    ds = datasets.synthetic(7, seed=3)
    reqs = workloads.build_requests(ds, "rerank-pointwise")
    assert [(r.route, r.body, r.items) for r in reqs] == [
        ("/rerank", {"query": s.query, "texts": [p]}, 1) for s in ds.samples for p in s.passages]
    assert reqs == workloads.build_requests(ds, "rerank", batch_size=1)
    custom = workloads.build_requests(ds, "rerank-pointwise", instruction="Find recipes")
    assert all(r.body["instruction"] == "Find recipes" for r in custom)
    with pytest.raises(ValueError, match="one item per request"):
        workloads.build_requests(ds, "rerank-pointwise", batch_size=2)


# ---------------------------------------------------------------- embed-query


def test_embed_query_prepends_the_query_prompt():
    ds = datasets.synthetic(9, seed=4)
    reqs = workloads.build_requests(ds, "embed-query")
    prompt = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
    assert [(r.route, r.body, r.items) for r in reqs] == [
        ("/embed", {"inputs": [prompt + s.query]}, 1) for s in ds.samples]
    other = workloads.build_requests(ds, "embed-query", instruction="Retrieve code")
    assert other[0].body["inputs"] == ["Instruct: Retrieve code\nQuery:" + ds.samples[0].query]
    with pytest.raises(ValueError, match="one item per request"):
        workloads.build_requests(ds, "embed-query", batch_size=4)


def test_embed_query_tokens_equal_the_servers_query_prompt(tiny_embedding_dir):
    """The checkpoint's own "query" prompt, applied the way the server applies prompt_name, gives
    exactly the tokens of the client-side text."""
    from tokenizers import Tokenizer

    from models.text import prompts
    st = json.loads((Path(tiny_embedding_dir) / "config_sentence_transformers.json").read_text())
    tok = Tokenizer.from_file(str(Path(tiny_embedding_dir) / "tokenizer.json"))
    ds = datasets.synthetic(6, seed=1)
    sent = [r.body["inputs"][0] for r in workloads.build_requests(ds, "embed-query")]
    served = prompts.encode_embedding_inputs(tok, [s.query for s in ds.samples], prompt=st["prompts"]["query"],
                                             max_length=4096, truncate=False)
    ours = prompts.encode_embedding_inputs(tok, sent, max_length=4096, truncate=False)
    assert ours == served and len(ours) == 6


# ---------------------------------------------------------------- embed-chunks


def test_documents_cut_the_passage_stream():
    ds = datasets.synthetic(30, seed=2)
    docs = documents.documents(ds, chunking=SMALL, seed=7)
    words = _words(ds)
    flat = [w for doc, _ in docs for w in doc.split()]
    assert flat == words[: len(flat)] and len(words) - len(flat) < SMALL.doc_words[1]  # only a short tail dropped
    for doc, chunks in docs:
        assert 200 <= len(doc.split()) <= 300
        assert " ".join(chunks) == doc and all(c in doc for c in chunks)
        sizes = [len(c.split()) for c in chunks]
        assert all(20 <= n <= 40 for n in sizes[:-1]) and 20 <= sizes[-1] <= 40 + 20 - 1
    assert docs == documents.documents(ds, chunking=SMALL, seed=7)
    assert docs != documents.documents(ds, chunking=SMALL, seed=8)
    with pytest.raises(ValueError, match="raise --queries or lower --doc-words"):
        documents.documents(datasets.synthetic(1, seed=0), seed=0)
    for bad in (dict(doc_words=(0, 5)), dict(chunk_words=(9, 3)), dict(doc_words=(1.5, 3))):
        with pytest.raises(ValueError):
            documents.Chunking(**bad)


def test_default_chunking_sizes_in_tokens(tiny_embedding_dir):
    """Defaults give documents of ~1000-2000 tokens and chunks from ~128 tokens (real Qwen BPE)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tiny_embedding_dir) / "tokenizer.json"))
    n = lambda t: len(tok.encode(t, add_special_tokens=False).ids)  # noqa: E731
    docs = documents.documents(datasets.synthetic(60, seed=0), seed=0)
    assert len(docs) >= 15
    assert all(1000 <= n(d) <= 2000 for d, _ in docs)
    inner = [n(c) for _, cs in docs for c in cs[:-1]]
    assert 120 <= min(inner) and max(inner) <= 260


def test_embed_chunks_requests_go_document_by_document():
    ds = datasets.synthetic(30, seed=2)
    reqs = workloads.build_requests(ds, "embed-chunks", chunking=SMALL, seed=7, model="m")
    docs = documents.documents(ds, chunking=SMALL, seed=7)
    want = [[doc + workloads.CHUNK_SEPARATOR + c] for doc, chunks in docs for c in chunks]
    assert [r.body["input"] for r in reqs] == want
    assert all(r.route == "/v1/embeddings" and r.items == 1 and r.body["model"] == "m" for r in reqs)
    # Consecutive requests share the whole document; each document is one contiguous run.
    prefixes = [r.body["input"][0].split(workloads.CHUNK_SEPARATOR)[0] for r in reqs]
    runs = [p for i, p in enumerate(prefixes) if i == 0 or p != prefixes[i - 1]]
    assert runs == [doc for doc, _ in docs] and len(set(runs)) == len(runs)
    assert reqs == workloads.build_requests(ds, "embed-chunks", chunking=SMALL, seed=7, model="m")
    assert reqs != workloads.build_requests(ds, "embed-chunks", chunking=SMALL, seed=1, model="m")
    with pytest.raises(ValueError, match="one item per request"):
        workloads.build_requests(ds, "embed-chunks", batch_size=1)


def test_embed_chunks_interleave_keeps_each_document_in_order():
    ds = datasets.synthetic(30, seed=2)
    docs = documents.documents(ds, chunking=SMALL, seed=7)
    users = 3
    reqs = workloads.build_requests(ds, "embed-chunks", chunking=SMALL, seed=7, order=f"interleave:{users}")
    texts = [r.body["input"][0] for r in reqs]
    assert sorted(texts) == sorted(d + workloads.CHUNK_SEPARATOR + c for d, cs in docs for c in cs)
    for u in range(users):
        mine = [d for d, _ in docs[u::users]]
        got = [t for t in texts if t.split(workloads.CHUNK_SEPARATOR)[0] in mine]
        assert got == [d + workloads.CHUNK_SEPARATOR + c for d, cs in docs[u::users] for c in cs]
    assert texts[:users] == [docs[u][0] + workloads.CHUNK_SEPARATOR + docs[u][1][0] for u in range(users)]


@pytest.mark.parametrize("workload", workloads.ONE_ITEM)
def test_same_seed_same_requests(workload):
    kw = dict(chunking=SMALL)
    a = workloads.build_requests(datasets.synthetic(20, seed=5), workload, seed=5, **kw)
    assert a == workloads.build_requests(datasets.synthetic(20, seed=5), workload, seed=5, **kw)
    assert a != workloads.build_requests(datasets.synthetic(20, seed=6), workload, seed=6, **kw)


def test_cli_records_chunking_and_rejects_batch_size(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(client, "probe", lambda url: None)
    monkeypatch.setattr(client, "run", lambda reqs, cfg: seen.setdefault("reqs", reqs) and client.RunResult(
        latencies_s=[0.01] * len(reqs), items_ok=len(reqs), sent=len(reqs), wall_s=1.0))
    common = ["run", "--url", "http://127.0.0.1:9", "--source", "synthetic", "--queries", "12", "--seed", "3",
              "--workload", "embed-chunks", "--doc-words", "200,300", "--chunk-words", "20,40", "--quiet"]
    assert cli.main([*common, "--out", str(tmp_path)]) == 0
    assert seen["reqs"] == workloads.build_requests(datasets.synthetic(12, seed=3), "embed-chunks",
                                                    chunking=SMALL, seed=3)
    run = json.loads((tmp_path / "report.json").read_text())["runs"][0]
    assert (run["chunking"], run["batch_size"]) == ("doc_words=200-300,chunk_words=20-40", 1)
    assert "- chunking: doc_words=200-300,chunk_words=20-40" in (tmp_path / "report.md").read_text()
    capsys.readouterr()
    assert cli.main([*common, "--batch-size", "4"]) == 2
    assert "--batch-size does not apply to embed-chunks" in capsys.readouterr().err
    assert cli.main([*common[:-5], "--queries", "1", "--quiet"]) == 2
    assert "raise --queries or lower --doc-words" in capsys.readouterr().err


# ---------------------------------------------------------------- the real server


def _have_server() -> bool:
    try:
        import server.app  # noqa: F401
    except Exception:
        return False
    return True


def _serve(model_dir: str):
    from tests.serving import serve

    return serve(model_dir, radix_mlp_threshold=1.0)


@pytest.mark.slow
@pytest.mark.skipif(not _have_server(), reason="server package not importable")
def test_prefix_workloads_against_radixserve(tiny_embedding_dir, tiny_reranker_dir):
    """Each workload runs clean on the real server, and the server counts exactly the tokens of
    the measured requests (computed here with models.text.prompts from the request texts)."""
    from models.text import prompts
    from tests.serving import cached_runner

    ds = datasets.synthetic(12, seed=0)
    cfg = client.RunConfig(url="", concurrency=2, requests=6, warmup=1, progress=False)
    cases = [(str(tiny_embedding_dir), "embed-query"), (str(tiny_embedding_dir), "embed-chunks"),
             (str(tiny_reranker_dir), "rerank-pointwise")]
    for model_dir, workload in cases:
        reqs = workloads.build_requests(ds, workload, chunking=SMALL)
        tok = cached_runner(model_dir).tokenizer
        srv = _serve(model_dir)
        try:
            res = client.run(reqs, dataclasses.replace(cfg, url=srv.url))
        finally:
            srv.stop()
        assert res.ok == 6 and not res.errors, (workload, res.errors)
        sent = [reqs[i % len(reqs)].body for i in range(6)]
        if workload == "rerank-pointwise":
            template = prompts.RerankTemplate(tok)
            want = sum(len(ids) for b in sent for ids in template.encode(b["query"], b["texts"], max_length=32768,
                                                                          truncate=False))
        else:
            texts = [t for b in sent for t in b.get("inputs", b.get("input"))]
            want = sum(map(len, prompts.encode_embedding_inputs(tok, texts, max_length=32768, truncate=False)))
        assert res.metrics.tokens_original == want, workload

"""The token batches of the prefix-cache benchmarks' loads (bench_cache.py and its --host part,
bench_cache_host.py): synthetic MS MARCO-like data, tokenized as the server would."""
from __future__ import annotations

from loadtest.datasets import synthetic
from models.runner import Runner
from models.text.prompts import DEFAULT_INSTRUCTION, RerankTemplate, embedding_query_prompt

WORKLOADS = ("rerank-1", "rerank-4", "query", "embed-template", "chunks")
KIND = {"rerank-1": "reranker", "rerank-4": "reranker", "query": "embedding",
        "embed-template": "embedding", "chunks": "embedding"}


def _template_text(query: str, doc: str) -> str:
    from models.text.prompts import RERANK_PREFIX, RERANK_SUFFIX, format_rerank_body

    return RERANK_PREFIX + format_rerank_body(DEFAULT_INSTRUCTION, query, doc) + RERANK_SUFFIX


def workload_batches(name: str, runner: Runner, *, n: int, seed: int) -> list[list[list[int]]]:
    """Token id lists of each batch of workload `name` (n batches)."""
    tok = runner.tokenizer
    data = synthetic(max(4, 10 * n if name == "embed-template" else n), seed=seed).samples
    pairs = [(s.query, p) for s in data for p in s.passages]
    if name in ("rerank-1", "rerank-4"):
        per = 1 if name == "rerank-1" else 4
        tmpl = RerankTemplate(tok)
        out = []
        for s in data:  # a query's passages in batches of `per`
            for i in range(0, len(s.passages) - per + 1, per):
                out.append(tmpl.encode(s.query, s.passages[i:i + per], max_length=8192, truncate=True))
        return out[:n]
    if name == "query":
        prompt = embedding_query_prompt(DEFAULT_INSTRUCTION)
        return [[tok.encode(prompt + s.query).ids] for s in data[:n]]
    if name == "embed-template":
        texts = [_template_text(q, p) for q, p in pairs]
        ids = [e.ids for e in tok.encode_batch(texts)]
        return [ids[i:i + 64] for i in range(0, len(ids) - 63, 64)][:n]
    if name == "chunks":
        doc_words = " ".join(p for s in data for p in s.passages).split()
        chunk, out = 60, []
        for d in range(0, len(doc_words), 1000):  # documents of 1000 words, chunks of 60
            words = doc_words[d:d + 1000]
            if len(words) < 1000:
                break
            doc = " ".join(words)
            for c in range(0, 1000, chunk):
                out.append([tok.encode(f"{doc}\n\nChunk: {' '.join(words[c:c + chunk])}").ids])
        return out[:n]
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")

"""Turn a Dataset into the HTTP requests of one workload.

- `rerank`: POST /rerank {query, texts}: one request per query with all of its passages.
- `embed-template` (the paper's setup): each (query, passage) pair rendered with the Qwen3-Reranker
  template as plain text, sent to /v1/embeddings in requests of `batch_size` (64) items. Pairs of
  one query are adjacent, so a request shares system prompt + instruction + query across them.
- `flipped`: the same template with query and passage swapped: only the system prompt and the
  instruction are shared, the worst case for prefix deduplication.
- `embed`: the bare passages to /v1/embeddings.
The request order is deterministic (dataset order); the client cycles through it.
"""
from __future__ import annotations

from dataclasses import dataclass

from loadtest.datasets import Dataset

WORKLOADS = ("rerank", "embed-template", "flipped", "embed")

# Qwen3-Reranker template (DESIGN.md, "Qwen3 prompts"). A client-side copy on purpose: loadtest/
# speaks HTTP only and must not import the server's packages.
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class Request:
    route: str  # "/rerank" or "/v1/embeddings"
    body: dict
    items: int  # input items carried (passages or texts)


def render_pair(query: str, document: str, *, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """prefix + `<Instruct>: {instruction}\\n<Query>: {q}\\n<Document>: {d}` + suffix."""
    return f"{RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{RERANK_SUFFIX}"


def _chunks(items: list[str], size: int) -> list[list[str]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def build_requests(
    dataset: Dataset,
    workload: str,
    *,
    batch_size: int = 64,
    instruction: str = DEFAULT_INSTRUCTION,
    model: str | None = None,
) -> list[Request]:
    """All requests of one pass over the dataset for `workload`."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if workload == "rerank":
        return [
            Request("/rerank", {"query": s.query, "texts": list(s.passages)}, len(s.passages))
            for s in dataset.samples
            if s.passages
        ]
    if workload == "embed":
        texts = [p for s in dataset.samples for p in s.passages]
    elif workload == "embed-template":
        texts = [render_pair(s.query, p, instruction=instruction) for s in dataset.samples for p in s.passages]
    else:  # flipped: the passage sits where the query was and vice versa
        texts = [render_pair(p, s.query, instruction=instruction) for s in dataset.samples for p in s.passages]
    out = []
    for chunk in _chunks(texts, batch_size):
        body: dict = {"input": chunk}
        if model:
            body["model"] = model
        out.append(Request("/v1/embeddings", body, len(chunk)))
    return out


def expected_count(body: dict) -> int:
    """How many results a correct answer to `body` holds (the client checks it)."""
    return len(body["texts"]) if "texts" in body else len(body["input"])

"""Which routes each runner kind serves, and what /info says of the model's head.

Invariant: one table (ROUTES) decides both what /info lists and what a refused route's 4xx
names, so the two never disagree. Kinds are the runner's (docs/architecture.md): "embedding",
"reranker" (a yes/no lm_head or a one-label score head), "classifier" (a score head of any
number of labels), "reward" (a one-label score head, read raw).
"""
from __future__ import annotations

from models.text import rerank_templates
from server.service.contract import ServedRunner

# kind -> the POST routes that run its model (the others answer 400 naming these)
ROUTES: dict[str, tuple[str, ...]] = {
    "embedding": ("/embed", "/v1/embeddings", "/similarity", "/embed_all", "/embeddings", "/v1/embed",
                  "/v2/embed"),
    "reranker": ("/rerank", "/v1/rerank", "/v2/rerank", "/infinity/rerank", "/score", "/v1/score"),
    "classifier": ("/predict", "/classify"),
    "reward": ("/pooling",),
}


# what every one-label score head serves, reranker or reward model: TEI scores it through /predict,
# vLLM through /classify, /pooling and /score (a pair joined by the tokenizer without a template)
SINGLE_SCORE: tuple[str, ...] = ("/predict", "/classify", "/pooling", "/score", "/v1/score")


def routes(kind: str, head: str = "") -> tuple[str, ...]:
    """The POST routes a model of this kind and head serves."""
    served = ROUTES.get(kind, ())
    if head == "score" and kind in ("reranker", "reward"):
        return served + tuple(r for r in SINGLE_SCORE if r not in served)
    return served


def use_instead(kind: str, head: str = "") -> str:
    """The routes a client should call instead, in words: "/rerank or /v1/rerank (also: ...)"."""
    served = routes(kind, head)
    head = " or ".join(served[:2]) or "none"
    return head + (f" (also: {', '.join(served[2:])})" if served[2:] else "")


def model_type(runner: ServedRunner) -> dict:
    """/info's `model_type`, TEI-style: {"embedding": {...}}, {"reranker": {...}},
    {"classifier": {...}} or {"reward": {...}}."""
    if runner.kind == "embedding":
        return {"embedding": {"pooling": runner.pooling}}
    if runner.head == "yes-no":
        score = rerank_templates.SCORES.get(runner.rerank_template, runner.rerank_template)
        return {"reranker": {"score": score, "template": runner.rerank_template}}
    why = getattr(runner, "head_reason", "")  # the mark, the flag or its absence (models/checkpoint/reranker_mark.py)
    if runner.kind == "reranker":
        return {"reranker": {"score": "sigmoid(score head)", "template": runner.rerank_template, "why": why}}
    if runner.kind == "reward":  # no reranker template: the rerank routes are not served
        return {"reward": {"score": "score head, raw", "template": None, "why": why}}
    return {"classifier": {"id2label": dict(enumerate(runner.labels))}}

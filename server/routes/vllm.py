"""vLLM's score-head routes: POST /classify, /score (and /v1/score), /pooling.

/classify (a classifier): `input` str or [str] -> {id, object: "list", created, model, data:
[{index, label, probs, num_classes}], usage}; probs are the softmax over the labels (sigmoid for a
one-label head), label the most probable one's id2label name. /score (a reranker): `text_1`
against one or many `text_2` (one text_1 for all, or one per text_2) -> {id, object: "list",
created, model, data: [{index, object: "score", score}], usage} in input order; score =
sigmoid(raw score) unless `use_activation` is false; a one-label score head without a reranker
template (a reward model) scores the pair as the tokenizer joins two texts, as vLLM does. /pooling (a reward model): `input` ->
{id, object: "list", created, model, data: [{index, object: "pooling", data: [raw score]}],
usage}. `truncate_prompt_tokens` n keeps each input's last n tokens (-1: the server's maximum);
without it, --auto-truncate decides. usage: {prompt_tokens, total_tokens, completion_tokens: 0,
prompt_tokens_details: null}. A route the loaded head cannot serve is a 400 naming those it can.
"""
from __future__ import annotations

import time
import uuid

import numpy as np
from fastapi import APIRouter, Request, Response

from server.http.bodies import openapi_body, parse_body
from server.http.errors import ApiError
from server.schemas.vllm import ClassifyRequest, PoolingRequest, ScoreRequest
from server.service import scoring
from server.service.core import Service
from server.service.encoding import RECORD_VALUES, dumps, json_answer, render
from server.service.results import Scores, Usage, sigmoid


def _usage(usage: Usage) -> dict:
    return {"prompt_tokens": usage.tokens, "total_tokens": usage.tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _texts(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


class VllmRoutes:
    """The vLLM score-head handlers of one app, bound to its service and the served model name."""

    def __init__(self, service: Service, *, model_name: str) -> None:
        self.service = service
        self.model_name = model_name
        self.max_items = service.limits.max_client_batch_size

    def _truncation(self, n: int | None) -> tuple[bool, str, int | None]:
        """(truncate, direction, cap) for vLLM's truncate_prompt_tokens (None: the server's rule)."""
        if n is None:
            return self.service.truncate(None), "right", None
        least = self.service.runner.tokenizer.num_special_tokens_to_add(False) + 1  # the schema's minimum
        if n == 0 or 0 < n < least:
            raise ApiError("validation", f"truncate_prompt_tokens must be -1 or at least {least} (the special "
                                         f"tokens this model adds and one token of the text)")
        return True, "left", None if n == -1 else n

    def _envelope(self, prefix: str, data: list, usage: Usage) -> bytes:
        return dumps({"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                      "model": self.model_name, "data": data, "usage": _usage(usage)})

    async def _head_logits(self, request: Request, route: str, kind: str,
                           model: type[ClassifyRequest] | type[PoolingRequest]):
        """/classify's and /pooling's common path: the body's inputs -> (texts, the head's logits)."""
        service = self.service
        call = service.begin(route.lstrip("/"))
        service.require(kind, route)
        body = await parse_body(request, model, max_items=self.max_items)
        service.check_model(body.model)
        texts = _texts(body.input)
        service.check_inputs(len(texts), empty=any(t == "" for t in texts), what="input")
        truncate, direction, cap = self._truncation(body.truncate_prompt_tokens)
        out = await scoring.logits(service, request, call, texts, truncate=truncate, direction=direction,
                                   cap=cap)
        return texts, out

    async def classify(self, request: Request) -> Response:
        texts, out = await self._head_logits(request, "/classify", "classifier", ClassifyRequest)

        def build() -> bytes:
            probs = out.probabilities()
            data = [{"index": i, "label": out.labels[int(np.argmax(row))], "probs": [float(p) for p in row],
                     "num_classes": len(row)} for i, row in enumerate(probs)]
            return self._envelope("classify", data, out.usage)

        return json_answer(await render(build, weight=RECORD_VALUES * len(texts) * len(out.labels)),
                           out.usage.headers())

    async def score(self, request: Request) -> Response:
        service = self.service
        call = service.begin("score")
        service.require("reranker", request.scope["path"])
        body = await parse_body(request, ScoreRequest, max_items=self.max_items)
        service.check_model(body.model)
        left, right = _texts(body.text_1), _texts(body.text_2)
        if len(left) not in (1, len(right)):
            raise ApiError("validation", f"text_1 holds {len(left)} texts and text_2 {len(right)}: send one "
                                         "text_1, or as many as text_2")
        service.check_inputs(len(right), empty=any(t == "" for t in left), what="text_2")
        pairs = [(left[0] if len(left) == 1 else left[i], doc) for i, doc in enumerate(right)]
        truncate, direction, cap = self._truncation(body.truncate_prompt_tokens)
        if cap is not None:
            raise ApiError("validation", "truncate_prompt_tokens on /score may only be -1 (cut each pair's "
                                         "document to the server's maximum)")
        if service.runner.kind == "reranker":  # the reranker's template
            result = await scoring.pair_scores(service, request, call, pairs,
                                               instruction=self.service.runner.rerank_instruction,
                                               truncate=truncate, direction="right")
        else:  # a one-label score head without a template: the tokenizer's pair (vLLM's cross-encoder)
            out = await scoring.logits(service, request, call, pairs, truncate=truncate, direction="right")
            result = Scores([float(v) for v in out.values[:, 0]], out.usage)
        activate = body.use_activation is not False

        def build() -> bytes:
            data = [{"index": i, "object": "score", "score": sigmoid(s) if activate else s}
                    for i, s in enumerate(result.raw)]
            return self._envelope("score", data, result.usage)

        return json_answer(await render(build, weight=RECORD_VALUES * len(pairs)), result.usage.headers())

    async def pooling(self, request: Request) -> Response:
        texts, out = await self._head_logits(request, "/pooling", "reward", PoolingRequest)

        def build() -> bytes:
            data = [{"index": i, "object": "pooling", "data": [float(v) for v in row]}
                    for i, row in enumerate(out.values)]
            return self._envelope("pool", data, out.usage)

        return json_answer(await render(build, weight=RECORD_VALUES * len(texts)), out.usage.headers())


def build_router(service: Service, *, model_name: str) -> APIRouter:
    vllm = VllmRoutes(service, model_name=model_name)
    router = APIRouter()

    def post(path: str, endpoint, body_model, summary: str, *, schema: bool = True) -> None:
        router.add_api_route(path, endpoint, methods=["POST"], tags=["vLLM"], summary=summary,
                             openapi_extra=openapi_body(body_model), include_in_schema=schema)

    post("/classify", vllm.classify, ClassifyRequest, "vLLM: labels of texts (a classifier)")
    post("/score", vllm.score, ScoreRequest, "vLLM: text_1 against text_2 (a reranker)")
    post("/v1/score", vllm.score, ScoreRequest, "vLLM: as /score")
    post("/pooling", vllm.pooling, PoolingRequest, "vLLM: raw score per text (a reward model)")
    return router

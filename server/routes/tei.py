"""TEI's dialect: POST /embed, /rerank, /similarity, /embed_all, /tokenize, /decode, POST / and
/invocations (dispatch), GET / and /ping (health); /predict and /embed_sparse (classifiers and
SPLADE, not served here) answer a 400 that names the route to use.

/embed: inputs str or [str] -> [[float]], normalized unless normalize=false, Matryoshka
``dimensions`` cut first. /rerank: query + texts -> [{index, score, text?}] by score, descending
(sigmoid of the raw score unless raw_scores); an empty document is scored like any other (its
templated input is not empty), an empty query or list is 400. A /rerank body with ``documents``
and no ``texts`` (what vLLM and Infinity accept there, and litellm's hosted_vllm/ and infinity/
send) is answered in vLLM's dialect: {id, model, results: [{index, relevance_score, document?:
{text}}], usage}, sorted, cut to top_n. POST / and POST /invocations
(SageMaker's name) answer as the route that serves the body would: /rerank for a reranker; for an
embedding model /similarity when ``inputs`` is a JSON object ({source_sentence, sentences}), else
/embed. The body is parsed once (server/http/bodies.py, with a ``pick`` on the parsed JSON) and
handed to that route's own code, so answers, errors, metrics and headers are exactly the
target's. /embed_all answers each token's final hidden state (after the final norm), read from the
compact rows through the radix index's scatter: no uncompacted forward is ever run for it; a
request may hold at most as many tokens as one /tokenize answer (max_batch_tokens).
"""
from __future__ import annotations

import time
import uuid
from typing import Union, cast

from fastapi import APIRouter, Request, Response

from models import prompts
from server.http.bodies import openapi_body, parse_body
from server.http.errors import ApiError
from server.routes.schemas import EmbedRequest, Rank, RerankRequest, SimpleToken, TokenizeRequest
from server.routes.schemas_compat import (DecodeRequest, DocumentsRerankRequest, DocumentsRerankResponse, EmbedAllRequest,
                                          SimilarityRequest)
from server.service.core import Call, Service
from server.service.encoding import RECORD_VALUES, dumps, float_array, json_answer, ragged_array, render
from server.service.results import ranked

DISPATCHED = ("/", "/invocations")
# TEI routes of model kinds not served here -> what they serve (their answer names the route to use).
UNSERVED = {"/predict": "sequence classification models", "/embed_sparse": "SPLADE sparse embeddings"}


def embedding_body(data: dict) -> type[EmbedRequest | SimilarityRequest]:
    """POST / on an embedding model: /similarity's body when ``inputs`` is an object, else /embed's."""
    return SimilarityRequest if isinstance(data.get("inputs"), dict) else EmbedRequest


def rerank_body(data: dict) -> type[RerankRequest | DocumentsRerankRequest]:
    """/rerank's two shapes: TEI's (``texts``), or Cohere/Jina/Infinity/vLLM's (``documents``, no ``texts``)."""
    return DocumentsRerankRequest if "documents" in data and "texts" not in data else RerankRequest


def texts_of(inputs: str | list[str]) -> list[str]:
    return [inputs] if isinstance(inputs, str) else inputs


def id_lists(ids: list[int] | list[list[int]]) -> list[list[int]]:
    """/decode's ids: one id list or several -> several."""
    if ids and not isinstance(ids[0], int):
        return cast("list[list[int]]", ids)
    return [cast("list[int]", ids)]


class TeiRoutes:
    """The TEI handlers of one app, bound to its service."""

    def __init__(self, service: Service, *, model_name: str) -> None:
        self.service = service
        self.model_name = model_name
        self.max_items = service.limits.max_client_batch_size

    # -- answers shared by a route and the dispatch ----------------------------------------------
    async def answer_embed(self, request: Request, body: EmbedRequest, call: Call) -> Response:
        service = self.service
        texts = texts_of(body.inputs)
        service.check_inputs(len(texts), empty=any(t == "" for t in texts))
        service.check_dimensions(body.dimensions)
        prompt = service.resolve_prompt(body.prompt_name)
        result = await service.embed(
            request, call, texts, prompt=prompt, truncate=service.truncate(body.truncate),
            direction=body.truncation_direction, dimensions=body.dimensions, normalize=body.normalize,
        )
        vectors = result.vectors
        return json_answer(await render(lambda: float_array(vectors), weight=vectors.size), result.usage.headers())

    async def answer_rerank(self, request: Request, body: RerankRequest, call: Call) -> Response:
        service = self.service
        service.check_inputs(len(body.texts), query=body.query, what="texts")
        result = await service.rerank(
            request, call, body.query, body.texts, truncate=service.truncate(body.truncate),
            direction=body.truncation_direction,
            instruction=body.instruction if body.instruction is not None else prompts.DEFAULT_INSTRUCTION,
        )

        def build() -> bytes:
            scores = result.raw if body.raw_scores else result.relevance()
            out = []
            for i in ranked(scores):
                item: dict = {"index": i, "score": scores[i]}
                if body.return_text:
                    item["text"] = body.texts[i]
                out.append(item)
            return dumps(out)

        return json_answer(await render(build, weight=RECORD_VALUES * len(body.texts)), result.usage.headers())

    async def answer_documents(self, request: Request, body: DocumentsRerankRequest, call: Call) -> Response:
        """/rerank given ``documents``: vLLM's answer (Jina's and Cohere v1's results), cut to top_n."""
        service = self.service
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        service.check_inputs(len(texts), query=body.query, what="documents")
        result = await service.rerank(
            request, call, body.query, texts, truncate=service.truncate(None), direction="right",
            instruction=body.instruction if body.instruction is not None else prompts.DEFAULT_INSTRUCTION,
        )

        def build() -> bytes:
            scores = result.relevance()
            results = []
            for i in ranked(scores)[: body.top_n]:
                item: dict = {"index": i, "relevance_score": scores[i]}
                if body.return_documents is not False:
                    item["document"] = {"text": texts[i]}
                results.append(item)
            tokens = result.usage.tokens
            return dumps({"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_name, "results": results,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

        return json_answer(await render(build, weight=RECORD_VALUES * len(texts)), result.usage.headers())

    async def answer_any_rerank(self, request: Request, call: Call) -> Response:
        """/rerank's body in either shape, answered in that shape's dialect."""
        # NOTE: ``pick`` may choose DocumentsRerankRequest; parse_body's typing knows one model only.
        body = await parse_body(request, RerankRequest, max_items=self.max_items,
                                pick=rerank_body)  # type: ignore[arg-type]
        if isinstance(body, DocumentsRerankRequest):
            return await self.answer_documents(request, body, call)
        return await self.answer_rerank(request, body, call)

    async def answer_similarity(self, request: Request, body: SimilarityRequest, call: Call) -> Response:
        service = self.service
        params = body.parameters
        texts = [body.inputs.source_sentence, *body.inputs.sentences]
        if not body.inputs.sentences:
            raise ApiError("empty", "inputs.sentences must not be empty")
        service.check_inputs(len(texts), empty=any(t == "" for t in texts))
        prompt = service.resolve_prompt(params.prompt_name if params else None)
        result = await service.similarity(
            request, call, texts, prompt=prompt, truncate=service.truncate(params.truncate if params else None),
            direction=params.truncation_direction if params else "right",
        )
        values = result.values
        return json_answer(await render(lambda: dumps(values), weight=len(values)), result.usage.headers())

    # -- routes ---------------------------------------------------------------------------------
    async def embed(self, request: Request) -> Response:
        """TEI embeddings: inputs str or [str] -> [[float]]."""
        call = self.service.begin("embed")
        self.service.require("embedding", "/embed")
        body = await parse_body(request, EmbedRequest, max_items=self.max_items)
        return await self.answer_embed(request, body, call)

    async def rerank(self, request: Request) -> Response:
        """TEI rerank: query + texts -> [{index, score, text?}] by score, descending."""
        call = self.service.begin("rerank")
        self.service.require("reranker", "/rerank")
        return await self.answer_any_rerank(request, call)

    async def similarity(self, request: Request) -> Response:
        """Cosine similarity of source_sentence with each of sentences, from our embeddings."""
        call = self.service.begin("similarity")
        self.service.require("embedding", "/similarity")
        body = await parse_body(request, SimilarityRequest, max_items=self.max_items)
        return await self.answer_similarity(request, body, call)

    async def dispatch(self, request: Request) -> Response:
        if self.service.runner.kind == "reranker":
            return await self.answer_any_rerank(request, self.service.begin("rerank"))
        start = time.perf_counter()
        parsed: EmbedRequest | SimilarityRequest | None = None
        try:
            # NOTE: ``pick`` may choose SimilarityRequest; parse_body's typing knows one model only.
            parsed = await parse_body(request, EmbedRequest, max_items=self.max_items,
                                      pick=embedding_body)  # type: ignore[arg-type]
        finally:  # NOTE: counted once the shape is known (a body that does not parse counts as embed)
            call = self.service.begin("similarity" if isinstance(parsed, SimilarityRequest) else "embed", start=start)
        if isinstance(parsed, SimilarityRequest):
            return await self.answer_similarity(request, parsed, call)
        return await self.answer_embed(request, parsed, call)

    async def embed_all(self, request: Request) -> Response:
        """Every token's final hidden state (after the final norm, not normalized): [[[float]]]."""
        service = self.service
        call = service.begin("embed_all")
        service.require("embedding", "/embed_all")
        body = await parse_body(request, EmbedAllRequest, max_items=self.max_items)
        texts = texts_of(body.inputs)
        service.check_inputs(len(texts), empty=any(t == "" for t in texts))
        prompt = service.resolve_prompt(body.prompt_name)
        result = await service.embed_all(
            request, call, texts, prompt=prompt, truncate=service.truncate(body.truncate),
            direction=body.truncation_direction,
        )
        states = result.states
        return json_answer(await render(lambda: ragged_array(states), weight=sum(s.size for s in states)),
                           result.usage.headers())

    async def tokenize(self, request: Request) -> Response:
        """Tokens with char offsets into the (prompt + input) string; at most max_batch_tokens
        tokens per request (422 above)."""
        self.service.begin("tokenize")
        body = await parse_body(request, TokenizeRequest, max_items=self.max_items)
        texts = texts_of(body.inputs)
        self.service.check_inputs(len(texts), empty=any(t == "" for t in texts))
        out = await self.service.tokenize(texts, prompt_name=body.prompt_name,
                                          add_special_tokens=body.add_special_tokens)
        return Response(out, media_type="application/json")

    async def decode(self, request: Request) -> Response:
        """Token ids -> text, one string per id list."""
        self.service.begin("decode")
        body = await parse_body(request, DecodeRequest, max_items=self.max_items)
        texts = await self.service.decode(id_lists(body.ids), skip_special_tokens=body.skip_special_tokens)
        weight = RECORD_VALUES * len(texts) + sum(map(len, texts)) // 8  # ~8 characters cost one float
        return json_answer(await render(lambda: dumps(texts), weight=weight))

    async def not_served(self, request: Request) -> Response:
        """TEI's routes for model kinds this server does not run: a 400 that names the route to use."""
        path = request.url.path
        what = UNSERVED[path]
        use = "/rerank or /v1/rerank" if self.service.runner.kind == "reranker" else "/embed or /v1/embeddings"
        raise ApiError(
            "wrong_model",
            f"{path} serves {what}; this server serves dense embeddings and rerankers (it runs a "
            f"{self.service.runner.kind} model, {self.service.runner.model_id}): use {use}",
        )

    async def healthy(self) -> Response:
        self.service.check_alive()
        return Response(status_code=200)


def build_router(service: Service, *, model_name: str) -> APIRouter:
    tei = TeiRoutes(service, model_name=model_name)
    router = APIRouter()

    def post(path: str, endpoint, response_model, *body_models) -> None:
        router.add_api_route(path, endpoint, methods=["POST"], response_model=response_model, tags=["TEI"],
                             openapi_extra=openapi_body(*body_models))

    post("/embed", tei.embed, list[list[float]], EmbedRequest)
    post("/rerank", tei.rerank, Union[list[Rank], DocumentsRerankResponse], RerankRequest,
         DocumentsRerankRequest)
    post("/tokenize", tei.tokenize, list[list[SimpleToken]], TokenizeRequest)
    router.add_api_route("/ping", tei.healthy, methods=["GET"], tags=["TEI"], summary="Health (SageMaker)")
    router.add_api_route("/", tei.healthy, methods=["GET"], tags=["TEI"], summary="Health (Inference API)")
    add_dispatch(router, tei)
    post("/similarity", tei.similarity, list[float], SimilarityRequest)
    post("/embed_all", tei.embed_all, list[list[list[float]]], EmbedAllRequest)
    post("/decode", tei.decode, list[str], DecodeRequest)
    for path, what in UNSERVED.items():
        router.add_api_route(path, tei.not_served, methods=["POST"], tags=["TEI"],
                             summary=f"Not served: {what}; answers 400 naming the route to use")
    return router


def add_dispatch(router: APIRouter, tei: TeiRoutes) -> None:
    """POST / and /invocations, documented as the route they dispatch to."""
    reranker = tei.service.runner.kind == "reranker"
    targets = "/rerank" if reranker else "/embed or /similarity"
    for path in DISPATCHED:
        router.add_api_route(
            path, tei.dispatch, methods=["POST"], tags=["TEI"], summary=f"TEI compat: dispatch to {targets}",
            description=f"Served as {targets} would serve the same body (an embedding model takes /similarity's "
                        "body when `inputs` is an object)." + (" SageMaker's route." if path == "/invocations" else ""),
            response_model=(Union[list[Rank], DocumentsRerankResponse] if reranker
                            else Union[list[list[float]], list[float]]),
            openapi_extra=(openapi_body(RerankRequest, DocumentsRerankRequest) if reranker
                           else openapi_body(EmbedRequest, SimilarityRequest)),
            operation_id=f"dispatch_{'root' if path == '/' else 'invocations'}_post",
        )

"""TEI's dialect: POST /embed, /rerank, /similarity, /embed_all, /tokenize, /decode, POST / and
/invocations (dispatch), /predict (a classifier), GET / and /ping (health); /embed_sparse (SPLADE,
not served here) answers a 400 that names the route to use.

/predict: `inputs` a string, a pair [str, str], or a batch [[str] or [str, str], ...] -> for each
input every label's {score, label}, by score descending: softmax over the labels (sigmoid for a
one-label head), the head's logits with `raw_scores`; a batch answers a list per input.

/embed: inputs str or [str] -> [[float]], normalized unless normalize=false, Matryoshka
``dimensions`` cut first. /rerank: query + texts -> [{index, score, text?}] by score, descending
(sigmoid of the raw score unless raw_scores); an empty document is scored like any other (its
templated input is not empty), an empty query or list is 400. A /rerank body with ``documents``
and no ``texts`` (what vLLM and Infinity accept there, and litellm's hosted_vllm/ and infinity/
send) is answered in vLLM's dialect: {id, model, results: [{index, relevance_score, document?:
{text}}], usage}, sorted, cut to top_n; when Infinity's routes are at the root (``--url-prefix /``,
Infinity's launch line's default) in Infinity's (a returned document a string, no documents unless
``return_documents``: server/routes/infinity.py); ``raw_scores`` (Infinity's) answers the raw score
in both. POST / and POST /invocations
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
from typing import Any, Union, cast

from fastapi import APIRouter, Request, Response

from server.http.bodies import openapi_body, parse_body
from server.http.errors import ApiError
from server.schemas.tei import EmbedRequest, Rank, RerankRequest, SimpleToken, TokenizeRequest
from server.schemas.cohere import CohereEmbedRequest
from server.schemas.tei import DecodeRequest, DocumentsRerankRequest, DocumentsRerankResponse, EmbedAllRequest, SimilarityRequest
from server.schemas.tei import PredictRequest, Prediction
from server.service import infinity_answers, scoring
from server.service.cohere_embed import answer_cohere_embed
from server.service.heads import use_instead
from server.service.core import Call, Service
from server.service.encoding import RECORD_VALUES, dumps, float_array, json_answer, ragged_array, render
from server.service.results import ranked

DISPATCHED = ("/", "/invocations")
# TEI routes of model kinds not served here -> what they serve (their answer names the route to use).
UNSERVED = {"/embed_sparse": "SPLADE sparse embeddings"}


def embedding_body(data: dict) -> type[EmbedRequest | SimilarityRequest | CohereEmbedRequest]:
    """POST / on an embedding model: /similarity's body when ``inputs`` is an object, Cohere's
    embed body (``texts``, no ``inputs``: litellm's ``cohere/`` posts it to the base URL), else /embed's."""
    if "texts" in data and "inputs" not in data:
        return CohereEmbedRequest
    return SimilarityRequest if isinstance(data.get("inputs"), dict) else EmbedRequest


def root_rerank_body(data: dict) -> type[RerankRequest | DocumentsRerankRequest]:
    """POST / on a reranker: /rerank's body; ``inputs`` without a query (a text-classification or
    feature-extraction call, e.g. huggingface_hub's) is refused naming the route to use."""
    if "inputs" in data and "query" not in data:
        raise ApiError(
            "wrong_model",
            "POST / on this server runs a reranker: it takes /rerank's body ({\"query\": ..., \"texts\": [...]} or "
            "\"documents\"); a body of \"inputs\" asks for text classification or embeddings, which a reranker "
            "does not serve: use POST /rerank (or /v1/rerank) with a query and documents")
    return rerank_body(data)


def rerank_body(data: dict) -> type[RerankRequest | DocumentsRerankRequest]:
    """/rerank's two shapes: TEI's (``texts``), or Cohere/Jina/Infinity/vLLM's (``documents``, no ``texts``)."""
    return DocumentsRerankRequest if "documents" in data and "texts" not in data else RerankRequest


def predict_items(inputs: str | list[str] | list[list[str]]) -> tuple[list[scoring.Text], bool]:
    """TEI's /predict inputs -> (texts and pairs, is it a batch): a string or [str] or [str, str]
    is one input; a list of lists is a batch of [str] or [str, str]."""
    if isinstance(inputs, str):
        return [inputs], False
    if inputs and all(isinstance(x, str) for x in inputs):
        return [_sequence(cast("list[str]", inputs))], False
    return [_sequence(cast("list[str]", x)) for x in inputs], True


def _sequence(parts: list[str]) -> scoring.Text:
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return (parts[0], parts[1])
    raise ApiError("validation", f"an input is a string or a pair of strings, got a list of {len(parts)}")


def texts_of(inputs: str | list[str]) -> list[str]:
    return [inputs] if isinstance(inputs, str) else inputs


def id_lists(ids: list[int] | list[list[int]]) -> list[list[int]]:
    """/decode's ids: one id list or several -> several."""
    if ids and not isinstance(ids[0], int):
        return cast("list[list[int]]", ids)
    return [cast("list[int]", ids)]


class TeiRoutes:
    """The TEI handlers of one app, bound to its service."""

    def __init__(self, service: Service, *, model_name: str, infinity_root: bool = False) -> None:
        self.service = service
        self.model_name = model_name
        self.infinity_root = infinity_root  # /rerank's documents body answered in Infinity's shape
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
            instruction=body.instruction if body.instruction is not None else self.service.runner.rerank_instruction,
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
        service.check_model(body.model)
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        service.check_inputs(len(texts), query=body.query, what="documents")
        result = await service.rerank(
            request, call, body.query, texts, truncate=service.truncate(None), direction="right",
            instruction=body.instruction if body.instruction is not None else self.service.runner.rerank_instruction,
        )

        def build() -> bytes:
            scores = result.raw if body.raw_scores else result.relevance()
            if self.infinity_root:
                return dumps(infinity_answers.rerank_answer(
                    scores, texts, top_n=body.top_n, return_documents=bool(body.return_documents),
                    model=self.model_name, tokens=result.usage.tokens))
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

    async def answer_any_rerank(self, request: Request, call: Call, pick=rerank_body) -> Response:
        """/rerank's body in either shape, answered in that shape's dialect."""
        # NOTE: ``pick`` may choose DocumentsRerankRequest; parse_body's typing knows one model only.
        body = await parse_body(request, RerankRequest, max_items=self.max_items, pick=pick)
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

    async def predict(self, request: Request) -> Response:
        """TEI classification: a text, a pair or a batch -> [{score, label}] per input, sorted."""
        service = self.service
        call = service.begin("predict")
        service.require("classifier", "/predict")
        body = await parse_body(request, PredictRequest, max_items=self.max_items)
        items, batch = predict_items(body.inputs)
        service.check_inputs(len(items), empty=any(t == "" for t in items))
        out = await scoring.logits(service, request, call, items, truncate=service.truncate(body.truncate),
                                   direction=body.truncation_direction)

        def build() -> bytes:
            scores = out.values if body.raw_scores else out.probabilities()
            answers = [[{"score": float(row[j]), "label": out.labels[j]} for j in ranked(list(row))]
                       for row in scores]
            return dumps(answers if batch else answers[0])

        return json_answer(await render(build, weight=RECORD_VALUES * len(items) * len(out.labels)),
                           out.usage.headers())

    async def dispatch(self, request: Request) -> Response:
        if self.service.runner.kind in ("classifier", "reward"):  # a reward model: TEI's /predict
            return await self.predict(request)
        if self.service.runner.kind == "reranker":
            return await self.answer_any_rerank(request, self.service.begin("rerank"), pick=root_rerank_body)
        self.service.require("embedding", request.scope["path"])  # a reward model: 400 naming /pooling
        start = time.perf_counter()
        parsed: EmbedRequest | SimilarityRequest | CohereEmbedRequest | None = None
        try:
            # NOTE: ``pick`` may choose another model; parse_body's typing knows one model only.
            parsed = await parse_body(request, EmbedRequest, max_items=self.max_items,
                                      pick=embedding_body)  # type: ignore[arg-type]
        finally:  # NOTE: counted once the shape is known (a body that does not parse counts as embed)
            endpoint = ("similarity" if isinstance(parsed, SimilarityRequest) else
                        "cohere_embed_v1" if isinstance(parsed, CohereEmbedRequest) else "embed")
            call = self.service.begin(endpoint, start=start)
        if isinstance(parsed, SimilarityRequest):
            return await self.answer_similarity(request, parsed, call)
        if isinstance(parsed, CohereEmbedRequest):
            return await answer_cohere_embed(self.service, request, parsed, call, version="1")
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
        path = request.scope["path"]
        what = UNSERVED[path]
        raise ApiError(
            "wrong_model",
            f"{path} serves {what}; this server serves dense embeddings and rerankers, and classification "
            f"heads (it runs a {self.service.runner.kind} model, {self.service.runner.model_id}): use "
            f"{use_instead(self.service.runner.kind, self.service.runner.head)}",
        )

    async def healthy(self) -> Response:
        self.service.check_alive()
        return Response(status_code=200)


def build_router(service: Service, *, model_name: str, infinity_root: bool = False) -> APIRouter:
    tei = TeiRoutes(service, model_name=model_name, infinity_root=infinity_root)
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
    post("/predict", tei.predict, Union[list[Prediction], list[list[Prediction]]], PredictRequest)
    for path, what in UNSERVED.items():
        router.add_api_route(path, tei.not_served, methods=["POST"], tags=["TEI"], deprecated=True,
                             summary=f"Not served: {what}; answers 400 naming the route to use")
    return router


def add_dispatch(router: APIRouter, tei: TeiRoutes) -> None:
    """POST / and /invocations, documented as the route they dispatch to."""
    kind = tei.service.runner.kind
    kind = "classifier" if kind == "reward" else kind  # a reward model answers / as /predict
    targets = {"reranker": "/rerank", "classifier": "/predict"}.get(kind, "/embed or /similarity")
    response: Any = {"reranker": Union[list[Rank], DocumentsRerankResponse],
                     "classifier": Union[list[Prediction], list[list[Prediction]]]}.get(
        kind, Union[list[list[float]], list[float]])
    body = {"reranker": openapi_body(RerankRequest, DocumentsRerankRequest),
            "classifier": openapi_body(PredictRequest)}.get(kind, openapi_body(EmbedRequest, SimilarityRequest))
    for path in DISPATCHED:
        router.add_api_route(
            path, tei.dispatch, methods=["POST"], tags=["TEI"], summary=f"TEI compat: dispatch to {targets}",
            description=f"Served as {targets} would serve the same body (an embedding model takes /similarity's "
                        "body when `inputs` is an object)." + (" SageMaker's route." if path == "/invocations" else ""),
            response_model=response, openapi_extra=body,
            operation_id=f"dispatch_{'root' if path == '/' else 'invocations'}_post",
        )

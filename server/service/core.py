"""The service every route calls: checks, permits, tokenization, the scheduler, domain results.

Order of checks (cheapest first, none of them queues anything): model kind (400), empty input
(400), too many inputs (422), worker alive (503), permits (429, at once), the memory budget for
the most tokens the body can hold (server/memory.py: 413 when the request can never fit, 429 when
not now); then tokenization (422 on bad input), the reservation shrunk to the tokens built, and
the scheduler. Routes run the checks their dialect needs, then call one of
``embed``, ``embed_ids``, ``rerank``, ``similarity``, ``embed_all``, ``tokenize``, ``decode``
and render the result (server/service/results.py). The invariants: permits taken for a request
are given back on every path out, including a client that disconnects while its items wait in
the queue; a failure inside the scheduler or model reaches the client as a generic body naming
the request id, and the log line with the same id has the details.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from starlette.requests import Request

from models.text import prompts
from scheduler import BatchFailed, SubmitResult, WorkerDead, stages
from scheduler.metrics import Metrics
from server import allocator
from server.http import cache_salt
from server.http.errors import ApiError, ClientGone, internal_message
from server.http.request_id import request_id
from server.memory import TOKEN_BYTES_BY_COST, MemoryBudget, estimate
from server.service.contract import ServedRunner, ServedScheduler
from server.service.encoding import render
from server.service.heads import routes, use_instead
from server.service.model_names import ModelNames
from server.service.permits import Permits
from server.service.results import (Embeddings, Scores, Similarities, TokenStates, Usage, cosines,
                                    shape_vectors)
from server.service.tokenization import Tokenization

log = logging.getLogger("radixserve.server")

Items = list[list[int]]
TRIM_AFTER_BYTES = 64 << 20  # a request that held this much: its freed memory is handed back after it
# A request still unanswered this long after its submit starts watching for its client leaving
# (a task each; a request answered sooner needs none). A client that left earlier is seen then.
WATCH_AFTER_S = 0.005


@dataclass(frozen=True)
class Limits:
    max_input_length: int
    max_client_batch_size: int
    auto_truncate: bool
    max_display_tokens: int = 16384  # tokens one /tokenize or /embed_all answer may hold (= max_batch_tokens)
    max_embed_all_floats: int = 4_194_304  # floats one /embed_all answer may hold (tokens x hidden size)
    max_rerank_pair_tokens: int = 1_048_576  # tokens of one rerank request's pairs together (0: no limit)


@dataclass(frozen=True)
class Call:
    """One counted request: its metric label and when it started."""

    method: str
    start: float


class Service:
    """Binds the runner, scheduler, tokenization, permits and metrics of one app."""

    def __init__(self, *, runner: ServedRunner, scheduler: ServedScheduler, metrics: Metrics, limits: Limits,
                 permits: Permits, default_prompt_name: str | None = None, default_prompt: str | None = None,
                 tokenization_workers: int = 2, memory: MemoryBudget | None = None,
                 model_names: ModelNames | None = None) -> None:
        self.runner = runner
        # which ``model`` a request may name (server/service/model_names.py); default: any
        self.model_names = model_names if model_names is not None else ModelNames(reported=runner.model_id)
        self.memory = memory if memory is not None else MemoryBudget(None)
        # The server's default prompt (flag) wins over the checkpoint's default_prompt_name.
        self.default_prompt = default_prompt
        self.default_prompt_name = default_prompt_name or runner.default_prompt_name
        self.scheduler = scheduler
        self.metrics = metrics
        self.limits = limits
        self.permits = permits
        self._by_method: dict[str, tuple[Any, Any]] = {}
        self.tok = Tokenization(
            runner, max_input_length=limits.max_input_length, metrics=metrics, workers=tokenization_workers,
            max_display_tokens=limits.max_display_tokens, max_pair_tokens=limits.max_rerank_pair_tokens,
        )

    # -- checks ---------------------------------------------------------------------------------
    def _counters(self, method: str) -> tuple[Any, Any]:
        """``method``'s request and success counters (a labelled child is looked up under a lock:
        kept per method, as the methods are the routes' fixed names)."""
        kids = self._by_method.get(method)
        if kids is None:
            m = self.metrics
            kids = self._by_method[method] = (m.request_count.labels(method=method),
                                              m.request_success.labels(method=method))
        return kids

    def begin(self, method: str, *, start: float | None = None) -> Call:
        """Count a request of ``method``; its clock starts now unless ``start`` says when it did."""
        self._counters(method)[0].inc()
        return Call(method, time.perf_counter() if start is None else start)

    def require(self, kind: str, route: str) -> None:
        if self.runner.kind != kind and route not in routes(self.runner.kind, self.runner.head):
            other = use_instead(self.runner.kind, self.runner.head)  # every route this model's head serves
            raise ApiError(
                "wrong_model",
                f"{route} needs a model of kind {kind!r}, but this server runs a model of kind "
                f"{self.runner.kind!r} ({self.runner.model_id}); use {other}",
            )

    def check_model(self, model: str | None) -> None:
        """404 ``model_not_found`` for a ``model`` this server does not answer to (see ModelNames)."""
        self.model_names.check(model)

    def check_inputs(self, n: int, *, empty: bool = False, what: str = "inputs", query: str | None = None) -> None:
        """400 for no inputs, an empty one, or an empty rerank ``query`` (named); 422 for too many."""
        if query == "":
            raise ApiError("empty", "query must not be empty")
        if n == 0 or empty:
            raise ApiError("empty", f"{what} must not be empty")
        if n > self.limits.max_client_batch_size:
            raise ApiError(
                "validation",
                f"{n} {what} in one request, more than the maximum of {self.limits.max_client_batch_size}",
            )

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and not 1 <= dimensions <= self.runner.hidden_size:
            raise ApiError("validation", f"dimensions must lie in [1, {self.runner.hidden_size}], got {dimensions}")

    def check_alive(self) -> None:
        """503 unless the model worker runs (/health and its aliases)."""
        if not self.scheduler.alive:
            raise ApiError("unhealthy", "the model worker is not running")

    def truncate(self, requested: bool | None) -> bool:
        return self.limits.auto_truncate if requested is None else requested

    def resolve_prompt(self, prompt_name: str | None) -> str:
        """The prompt text for ``prompt_name`` (None: the server's or the checkpoint's default)."""
        try:
            return prompts.resolve_prompt(
                self.runner.prompts or {}, prompt_name=prompt_name,
                default_prompt_name=self.default_prompt_name, default_prompt=self.default_prompt,
            )
        except prompts.UnknownPrompt as exc:
            raise ApiError("validation", str(exc)) from exc

    def admitted(self, n_items: int) -> "_Admitted":
        """Hold ``n_items`` permits for the ``with`` block; 429 at once when too few are left."""
        return _Admitted(self.permits, n_items)

    # -- domain calls ---------------------------------------------------------------------------
    async def embed(self, request: Request, call: Call, texts: Sequence[str], *, prompt: str, truncate: bool,
                    direction: str, dimensions: int | None, normalize: bool) -> Embeddings:
        """Pooled embeddings of ``texts`` (``prompt`` prepended), cut to ``dimensions``, normalized if asked."""

        async def encode() -> Items:
            return await self.tok.embedding_inputs(texts, prompt=prompt, truncate=truncate, direction=direction)

        outputs, usage = await self._infer(request, call, len(texts), encode, cost="embed",
                                           bound=self.tok.bound(texts, shared=prompt))
        return await self._shaped(outputs, usage, dimensions=dimensions, normalize=normalize)

    async def embed_ids(self, request: Request, call: Call, ids: Sequence[Sequence[int]], *, truncate: bool,
                        dimensions: int | None, normalize: bool) -> Embeddings:
        """As ``embed`` for pre-tokenized inputs: ids checked against the vocabulary first."""
        checked = self.tok.check_token_ids(ids, truncate=truncate)

        async def encode() -> Items:
            return checked

        outputs, usage = await self._infer(request, call, len(checked), encode, cost="embed",
                                           bound=sum(map(len, checked)))
        return await self._shaped(outputs, usage, dimensions=dimensions, normalize=normalize)

    async def _shaped(self, outputs: list, usage: Usage, *, dimensions: int | None, normalize: bool) -> Embeddings:
        """Pooled outputs -> Embeddings (off the loop when the answer is big)."""
        vectors = await render(lambda: shape_vectors(outputs, dimensions=dimensions, normalize=normalize),
                               weight=len(outputs) * self.runner.hidden_size)
        return Embeddings(vectors, usage)

    async def rerank(self, request: Request, call: Call, query: str, texts: Sequence[str], *, instruction: str,
                     truncate: bool, direction: str) -> Scores:
        """Raw scores of ``texts`` against ``query`` (the query is encoded once), in input order."""

        async def encode() -> Items:
            return await self.tok.rerank_inputs(
                query, texts, instruction=instruction, truncate=truncate, direction=direction
            )

        outputs, usage = await self._infer(request, call, len(texts), encode, cost="rerank",
                                           bound=self.tok.bound(texts, shared=query + instruction, pairs=True))
        return Scores([float(s) for s in outputs], usage)

    async def similarity(self, request: Request, call: Call, texts: Sequence[str], *, prompt: str, truncate: bool,
                         direction: str) -> Similarities:
        """Cosine similarity of ``texts[0]`` with each of ``texts[1:]``, from our embeddings."""

        async def encode() -> Items:
            return await self.tok.embedding_inputs(texts, prompt=prompt, truncate=truncate, direction=direction)

        outputs, usage = await self._infer(request, call, len(texts), encode, cost="embed",
                                           bound=self.tok.bound(texts, shared=prompt))
        values = await render(lambda: cosines(outputs), weight=len(outputs) * self.runner.hidden_size)
        return Similarities(values, usage)

    async def embed_all(self, request: Request, call: Call, texts: Sequence[str], *, prompt: str, truncate: bool,
                        direction: str) -> TokenStates:
        """Every token's final hidden state; at most ``max_display_tokens`` tokens and
        ``max_embed_all_floats`` output floats per request (422 naming the limit)."""
        # NOTE: token states are the model's width, not the Dense modules' (runner.hidden_size)
        cap, width, floats = (self.limits.max_display_tokens, self.runner.config.hidden_size,
                              self.limits.max_embed_all_floats)

        async def encode() -> Items:
            items = await self.tok.embedding_inputs(texts, prompt=prompt, truncate=truncate, direction=direction)
            n = sum(map(len, items))
            if n > cap:  # the answer holds E floats per token
                raise ApiError("validation", f"{n} tokens in one /embed_all request, more than the maximum of {cap}")
            if n * width > floats:
                raise ApiError(
                    "validation",
                    f"{n} tokens x {width} floats = {n * width} floats in one /embed_all answer, more than the "
                    f"maximum of {floats} (--max-embed-all-floats); send fewer or shorter inputs, or raise the limit",
                )
            return items

        outputs, usage = await self._infer(request, call, len(texts), encode, all_tokens=True, cost="embed_all",
                                           bound=min(cap, self.tok.bound(texts, shared=prompt)))
        return TokenStates(outputs, usage)

    async def tokenize(self, texts: Sequence[str], *, prompt_name: str | None, add_special_tokens: bool) -> bytes:
        """/tokenize's JSON bytes; an embedding model's prompt is prepended (a reranker's is none)."""
        prompt = self.resolve_prompt(prompt_name) if self.runner.kind == "embedding" else ""
        with self.admitted(len(texts)):
            out = await self.tok.display(texts, prompt=prompt, add_special_tokens=add_special_tokens)
        self.metrics.request_success.labels(method="tokenize").inc()
        return out

    async def decode(self, batch: list[list[int]], *, skip_special_tokens: bool) -> list[str]:
        """Token ids -> text, one string per id list; 422 for an id outside the vocabulary."""
        vocab = self.tok.vocab_size
        for i, ids in enumerate(batch):
            if ids and not (0 <= min(ids) and max(ids) < vocab):  # min/max run in C
                raise ApiError("validation", f"ids {i}: a token id lies outside the vocabulary [0, {vocab})")
        tok = self.tok.tokenizer
        with self.admitted(len(batch)):
            texts = await asyncio.get_running_loop().run_in_executor(
                self.tok.executor, lambda: tok.decode_batch(batch, skip_special_tokens=skip_special_tokens)
            )
        self.metrics.request_success.labels(method="decode").inc()
        return texts

    # -- the path -------------------------------------------------------------------------------
    async def _infer(self, request: Request, call: Call, n_items: int, encode: Callable[[], Awaitable[Items]], *,
                     bound: int, cost: str, all_tokens: bool = False) -> tuple[list[Any], Usage]:
        """Admit ``n_items``, build their token ids with ``await encode()``, run them, time them.

        ``bound``: at most how many tokens ``encode`` builds, from the body alone
        (``Tokenization.bound``): the memory budget is reserved for that many before any work,
        then shrunk to the tokens built; ``cost``: the route's bytes per token (server/memory.py).
        ``all_tokens``: each output is the item's [L, E] per-token states instead of its pooled one.
        """
        if not self.scheduler.alive:
            rid = request_id(request)
            raise ApiError("unhealthy", f"the model worker is not running; retry later (request id {rid})")
        width = 1 if self.runner.kind == "reranker" else self.runner.hidden_size  # a score, or a vector
        per_token = TOKEN_BYTES_BY_COST[cost]

        def bytes_for(tokens: int, items: int) -> int:
            floats = (tokens if all_tokens else items) * (self.runner.hidden_size if all_tokens else width)
            return estimate(tokens=tokens, answer_floats=floats, token_bytes=per_token)

        with self.admitted(n_items), self.memory.reserved(
                bytes_for(bound, n_items), what=f"up to {bound} tokens by its size, before tokenizing") as held:
            items = await encode()
            if stages.recorder is not None:  # opt-in stage stamps (benchmarks/bench_latency.py)
                stages.recorder("tokenized", (request_id(request),))
            tokens = sum(map(len, items))
            held.shrink(bytes_for(tokens, len(items)))
            result = await self._submit(request, items, all_tokens=all_tokens)
        del items
        if held.nbytes >= TRIM_AFTER_BYTES and self.memory.in_use == 0:
            self._release_free_memory()
        total = time.perf_counter() - call.start
        m = self.metrics
        m.request_duration.observe(total)
        m.queue_duration.observe(result.queue_time_s)
        m.inference_duration.observe(result.inference_time_s)
        self._counters(call.method)[1].inc()
        usage = Usage(tokens=tokens, queue_s=result.queue_time_s,
                      inference_s=result.inference_time_s, total_s=total, compute_tokens=int(result.compute_tokens))
        return list(result.outputs), usage

    def _release_free_memory(self) -> None:
        """After a large request with none other in flight: hand malloc's free pages back to the
        system in a worker thread (server/allocator.py; glibc keeps them otherwise)."""
        with contextlib.suppress(RuntimeError):  # no thread to be had now: the next large request trims
            asyncio.get_running_loop().run_in_executor(self.tok.executor, allocator.release_free_memory)

    async def _submit(self, request: Request, items: Items, *, all_tokens: bool) -> SubmitResult:
        """Await the scheduler in this task; cancel the entries when the client goes away first.

        A request still waiting ``WATCH_AFTER_S`` after its submit starts a disconnect watcher,
        which cancels this task when the client leaves (the scheduler's submit drops the entries
        still queued); that reads here as ``ClientGone``. The submit runs in this task rather than
        one of its own, so the answer reaches the route with one wake-up, and a request answered
        sooner (a lone short input) never makes a watcher: one timer, cancelled, is all it costs."""
        rid = request_id(request)
        task = asyncio.current_task()
        assert task is not None
        watcher: asyncio.Future | None = None
        waiting = True

        def leave(gone: asyncio.Future) -> None:  # on the loop, once the watcher ended
            if waiting and not gone.cancelled():
                task.cancel()

        def watch() -> None:  # on the loop: the request still waits
            nonlocal watcher
            watcher = asyncio.ensure_future(_disconnected(request))
            watcher.add_done_callback(leave)

        timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, watch)
        try:
            # NOTE: the item lists are fresh (the tokenizer's or check_token_ids'): handed over uncopied.
            return await self.scheduler.submit(items, request_id=rid, all_tokens=all_tokens,
                                               namespace=cache_salt.namespace(request))
        except asyncio.CancelledError:
            if watcher is None or not watcher.done() or watcher.cancelled():
                raise  # cancelled from outside (the server's drain): not this client's leaving
            _uncancel(task)
            raise ClientGone() from None
        except BatchFailed as exc:
            log.error("request id %s: %d items failed in the model: %s", rid, len(items), exc)
            raise ApiError("backend", internal_message(rid)) from exc
        except WorkerDead as exc:
            log.error("request id %s: the model worker is not available: %s", rid, exc)
            raise ApiError("unhealthy", f"the model worker is not available; retry later (request id {rid})") from exc
        finally:
            waiting = False
            timer.cancel()
            if watcher is not None:
                watcher.cancel()


def _uncancel(task: asyncio.Task) -> None:
    """Take back the cancellation this module asked for (3.11+ counts them; 3.10 does not)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is already consumed)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Admitted:
    """``Service.admitted``'s block: a plain context manager rather than a generator's (every
    inference request takes one)."""

    __slots__ = ("permits", "n_items")

    def __init__(self, permits: Permits, n_items: int) -> None:
        self.permits, self.n_items = permits, n_items

    def __enter__(self) -> None:
        permits = self.permits
        if not permits.try_acquire(self.n_items):
            raise ApiError("overloaded", f"too many concurrent inputs (limit {permits.total}, {permits.in_use} in "
                                         "flight); retry later")

    def __exit__(self, *exc: object) -> None:
        self.permits.release(self.n_items)

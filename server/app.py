"""The FastAPI app factory: wires runner, scheduler, service, routes, middlewares, errors and metrics.

``create_app(config, runner=None, scheduler=None)``: tests inject a runner and/or a scheduler;
whatever is not injected is built from ``config`` and owned by the app, which starts the
scheduler on start-up and stops it on shutdown: drained (``stop(drain=True)``) after uvicorn has
finished the in-flight HTTP requests, or, after a Lifecycle drain (SIGTERM or a dead worker,
server/http/lifecycle.py), stopped within the time left. An injected scheduler is started if it is
not running yet and left to its owner to stop. ``app.state.lifecycle`` is the app's drain state,
``app.state.service`` its service layer, ``app.state.info`` GET /info's body.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import APIRouter, FastAPI
from starlette.middleware.cors import CORSMiddleware

from scheduler.metrics import Metrics
from server.config import ServerConfig
from server.http.docs import install_docs
from server.http.errors import install_handlers
from server.http.express import ExpressLane
from server.http import tracing
from server.http.front_door import FrontDoor
from server.http.lifecycle import DrainGate, Lifecycle
from server.http.openapi import HeadAsGet, install_openapi
from server.memory import MemoryBudget, activation_bytes
from server.routes import cohere, infinity, openai, ops, tei, vllm
from server.service.contract import ServedRunner, ServedScheduler
from server.service.core import Limits, Service
from server.service.info import build_info, startup_line, version
from server.service.model_names import ModelNames
from server.service.permits import Permits

if TYPE_CHECKING:
    from scheduler import Scheduler

log = logging.getLogger("radixserve.server")


def max_input_length(config: ServerConfig, runner: ServedRunner) -> int:
    """min(model max positions, --max-input-length, --max-batch-tokens): every item fits a batch."""
    limit = min(int(runner.max_positions), config.max_batch_tokens)
    if config.max_input_length is not None:
        limit = min(limit, config.max_input_length)
    return limit


def load_runner(config: ServerConfig) -> ServedRunner:
    import models
    from models.lone_choice import LoneChoice

    runner = models.load_runner(
        config.model_id,
        revision=config.revision,
        device=config.device,
        dtype=config.dtype,
        radix_attention=config.radix_attention,
        pooling=config.pooling,
        kind=config.load_kind,
        radix_mlp_threshold=config.radix_mlp_threshold,
        prefix_cache_size=config.prefix_cache_size,
        cpu_packed_weights=config.cpu_packed_weights,
        cpu_weights=config.cpu_weights,
        keep_dense_weights=False,  # serving needs no gradients: one copy of the weights
        max_batch_tokens=config.max_batch_tokens,  # a CUDA `auto` prefix cache is sized after such a batch
        tree_attention=config.tree_attention,
        dense_path=config.dense_path,
        rerank_template=config.rerank_template,
        cuda_graphs=config.cuda_graphs,
    )
    runner.defer_copies = True  # on CUDA the scheduler waits for the outputs' copies on its own thread
    runner.lone_choice = LoneChoice()  # a lone short input: the cache and the threads that pay (models/lone_choice.py)
    return runner


def build_scheduler(config: ServerConfig, runner: ServedRunner, metrics: Metrics, *,
                    on_death: Callable[[BaseException], None] | None = None) -> Scheduler:
    from scheduler import Scheduler
    from scheduler.forming import PrefixPolicy

    if runner.radix_mlp_threshold != config.radix_mlp_threshold:  # an injected runner follows the config
        runner = dataclasses.replace(runner, radix_mlp_threshold=config.radix_mlp_threshold)  # type: ignore[type-var]  # ServedRunner is a Protocol; the real one is a dataclass
    return Scheduler(
        runner,
        max_batch_tokens=config.max_batch_tokens,
        max_batch_requests=config.max_batch_requests,
        metrics=metrics,
        policy=config.batching_policy,
        prefix_policy=PrefixPolicy(
            max_wait_s=config.batching_max_wait_ms / 1000.0, max_skips=config.batching_max_skips
        ),
        on_death=on_death,
        # on the worker thread, before the first batch (models/warmup.py)
        warm_up=functools.partial(runner.warm_up, max_tokens=config.max_batch_tokens),
        lane=True,  # a lone short query at an idle CPU pipeline runs on the loop (scheduler/lane.py)
    )


def tokenization_workers(config: ServerConfig) -> int:
    """--tokenization-workers, else TEI's CPU cores - 1 (here at least 2: one slow body must not stall all)."""
    if config.tokenization_workers is not None:
        return config.tokenization_workers
    return max(2, min(64, (os.cpu_count() or 2) - 1))


def host_activations(config: ServerConfig, runner: ServedRunner) -> int:
    """One full batch's activations in host memory (server/memory.py), 0 when the forward runs on
    a device or the runner does not say its widths (an injected test runner)."""
    hidden = getattr(runner.config, "hidden_size", None)
    intermediate = getattr(runner.config, "intermediate_size", None)
    itemsize = getattr(runner.dtype, "itemsize", None)
    if getattr(runner.device, "type", "cpu") != "cpu" or hidden is None or intermediate is None or not itemsize:
        return 0
    return activation_bytes(tokens=config.max_batch_tokens, hidden=int(hidden), intermediate=int(intermediate),
                            dtype_bytes=int(itemsize))


def build_service(config: ServerConfig, runner: ServedRunner, scheduler: ServedScheduler,
                  metrics: Metrics) -> Service:
    return Service(
        runner=runner,
        scheduler=scheduler,
        metrics=metrics,
        limits=Limits(
            max_input_length=max_input_length(config, runner),
            max_client_batch_size=config.max_client_batch_size,
            auto_truncate=config.auto_truncate,
            max_display_tokens=config.max_batch_tokens,
            max_embed_all_floats=config.max_embed_all_floats,
            max_rerank_pair_tokens=config.max_rerank_pair_tokens,
        ),
        permits=Permits(config.max_concurrent_requests),
        default_prompt_name=config.default_prompt_name,
        default_prompt=config.default_prompt,
        tokenization_workers=tokenization_workers(config),
        memory=MemoryBudget.detect(config.memory_limit, activations=host_activations(config, runner)),
        model_names=ModelNames.of(served=config.served_names, model_id=config.model_id),
    )


def lifespan_of(config: ServerConfig, service: Service, lifecycle: Lifecycle, *, owned: bool):
    """Start the scheduler when the app starts; stop an owned one (drained, or in the time left)."""
    scheduler = service.scheduler

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        lifecycle.bind(asyncio.get_running_loop())
        if not scheduler.alive:
            scheduler.start()
        log.info(startup_line(config, service.runner, service.limits.max_input_length))
        try:
            yield
        finally:
            if owned and lifecycle.draining:
                # NOTE: every request is answered by now; what still runs has nobody waiting.
                log.info("shutting down: stopping the scheduler (%.1f s left)", lifecycle.remaining())
                timeout = max(0.05, lifecycle.remaining() - 0.3)
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: scheduler.stop(drain=False, timeout=timeout))
            elif owned:
                log.info("shutting down: draining the scheduler")
                await asyncio.get_running_loop().run_in_executor(None, lambda: scheduler.stop(drain=True))
            service.tok.close()

    return lifespan


def add_middleware(app: FastAPI, config: ServerConfig, lifecycle: Lifecycle, *,
                   on_error: Callable[[str], None]) -> None:
    """Innermost first: the express lane, the front door, the drain gate, HEAD as GET, then CORS
    (outermost). The lane reads the app's routes and exception handlers when it serves."""
    app.add_middleware(ExpressLane, routes=app.router.routes, exception_handlers=app.exception_handlers)
    app.add_middleware(
        FrontDoor, payload_limit=config.payload_limit, api_key=config.api_key, on_error=on_error,
        body_timeout_s=config.body_read_timeout, compute_tokens_header=config.compute_tokens_header,
    )
    app.add_middleware(DrainGate, lifecycle=lifecycle)  # outside FrontDoor: a drain answers before auth
    app.add_middleware(HeadAsGet)  # HEAD on every GET route
    if config.cors_allow_origin:
        origins = ["*"] if "*" in config.cors_allow_origin else list(config.cors_allow_origin)
        app.add_middleware(  # outermost: preflights are answered without a key
            CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
            allow_headers=["content-type", "authorization"],
        )


def include_routers(app: FastAPI, routers: list[APIRouter]) -> None:
    """Each router's routes in order; a (path, method) an earlier router serves is left out of a later
    one, with a log line (Infinity's --url-prefix /v1 takes /v1/rerank and /v1/models)."""
    taken: set[tuple[str, str]] = set()
    for router in routers:
        kept = []
        for route in router.routes:
            path = getattr(route, "path", "")
            keys = {(path, m) for m in getattr(route, "methods", ())}
            if keys & taken:
                log.info("--url-prefix: %s answers in Infinity's shape", path)
                continue
            taken |= keys
            kept.append(route)
        router.routes[:] = kept
        app.include_router(router)


def create_app(config: ServerConfig, runner: ServedRunner | None = None,
               scheduler: ServedScheduler | None = None) -> FastAPI:
    if runner is None:
        runner = load_runner(config)
    metrics = scheduler.metrics if scheduler is not None and scheduler.metrics is not None else Metrics()
    lifecycle = Lifecycle(grace_s=config.graceful_shutdown_timeout)
    metrics.watch_prefix_cache(runner.prefix_cache)
    owned = scheduler is None
    if scheduler is None:
        scheduler = build_scheduler(config, runner, metrics, on_death=lifecycle.worker_died)
    service = build_service(config, runner, scheduler, metrics)
    app = FastAPI(
        title="radixserve",
        version=version(),
        description="Embeddings and reranking for causal-LM models with in-batch prefix deduplication (RadixMLP).",
        lifespan=lifespan_of(config, service, lifecycle, owned=owned),
        docs_url=None,  # served offline by install_docs
        redoc_url=None,
        **tracing.native_telemetry_off(),  # the span per request is server/http/tracing.py's
    )
    app.state.service = service
    app.state.config = config
    app.state.lifecycle = lifecycle

    def on_error(kind: str) -> None:
        metrics.request_failure.labels(err=kind).inc()

    install_handlers(app, on_error=on_error)
    info = app.state.info = build_info(config, runner, max_input_length=service.limits.max_input_length,
                                       tokenization_workers=service.tok.workers)
    prefix = config.url_prefix  # Infinity's: its routes at the prefix take precedence (server/routes/infinity.py)
    embeddings_at = tuple(f"{at}/embeddings" for at in infinity.routes_at(prefix) if at != "/v1")
    include_routers(app, [
        infinity.build_router(service, model_name=config.model_name, batch_size=config.max_batch_requests or config.max_batch_tokens,
                              prefix=prefix),
        tei.build_router(service, model_name=config.model_name, infinity_root=prefix == "/"),
        openai.build_router(service, model_name=config.model_name, allow_token_ids=config.allow_token_ids,
                            also_at=embeddings_at),
        cohere.build_router(service, model_name=config.model_name),
        vllm.build_router(service, model_name=config.model_name),
        ops.build_router(service, info=info),
    ])
    install_docs(app, title="radixserve")
    install_openapi(app, max_items=config.max_client_batch_size, vocab_size=service.tok.vocab_size,
                    hidden_size=runner.hidden_size, prompt_names=tuple(runner.prompts or {}),
                    min_truncate=runner.tokenizer.num_special_tokens_to_add(False) + 1)
    add_middleware(app, config, lifecycle, on_error=on_error)
    return app

"""The FastAPI app factory: wires runner, scheduler, admission, routes, errors and metrics.

``create_app(config, runner=None, scheduler=None)``: tests inject a runner and/or a scheduler;
whatever is not injected is built from ``config`` and owned by the app, which starts the
scheduler on start-up and stops it on shutdown: drained (``stop(drain=True)``) after uvicorn has
finished the in-flight HTTP requests, or, after a Lifecycle drain (SIGTERM or a dead worker,
server/lifecycle.py), stopped within the time left. An injected scheduler is started if it is not
running yet and left to its owner to stop. ``app.state.lifecycle`` is the app's drain state.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from fastapi import FastAPI, Request, Response
from starlette.middleware.cors import CORSMiddleware

from scheduler.metrics import Metrics
from server import routes_cohere, routes_embed, routes_misc, routes_openai, routes_rerank, routes_tei
from server.admission import Guard, Permits
from server.config import ServerConfig
from server.docs import install_docs
from server.errors import install_handlers
from server.lifecycle import DrainGuard, Lifecycle
from server.service import ClientGone, Limits, Service

log = logging.getLogger("radixserve.server")


def max_input_length(config: ServerConfig, runner) -> int:
    """min(model max positions, --max-input-length, --max-batch-tokens): every item fits a batch."""
    limit = min(int(runner.max_positions), config.max_batch_tokens)
    if config.max_input_length is not None:
        limit = min(limit, config.max_input_length)
    return limit


def load_runner(config: ServerConfig):
    import models

    return models.load_runner(
        config.model_id,
        revision=config.revision,
        device=config.device,
        dtype=config.dtype,
        radix_attention=config.radix_attention,
        pooling=config.pooling,
        radix_mlp_threshold=config.radix_mlp_threshold,
        prefix_cache_size=config.prefix_cache_size,
        cpu_packed_weights=config.cpu_packed_weights,
        keep_dense_weights=False,  # serving needs no gradients: one copy of the weights
    )


def build_scheduler(config: ServerConfig, runner, metrics: Metrics, *, on_death=None):
    import dataclasses

    from scheduler import Scheduler
    from scheduler.forming import PrefixPolicy

    if runner.radix_mlp_threshold != config.radix_mlp_threshold:  # an injected runner follows the config
        runner = dataclasses.replace(runner, radix_mlp_threshold=config.radix_mlp_threshold)
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
    )


def startup_line(config: ServerConfig, runner, max_len: int) -> str:
    return (
        f"radixserve serving model={config.model_name} ({runner.model_id}) kind={runner.kind} "
        f"device={runner.device} dtype={str(runner.dtype).replace('torch.', '')} "
        f"attention_backend={runner.attention_backend} kernels={runner.kernels} "
        f"linear={getattr(runner, 'linear', 'F.linear')} "
        f"radix_mlp_threshold={config.radix_mlp_threshold} radix_attention={runner.radix_attention} "
        f"batching_policy={config.batching_policy} "
        f"max_input_length={max_len} max_batch_tokens={config.max_batch_tokens} "
        f"max_concurrent_requests={config.max_concurrent_requests} on {config.hostname}:{config.port}"
    )


def create_app(config: ServerConfig, runner=None, scheduler=None) -> FastAPI:
    if runner is None:
        runner = load_runner(config)
    owned = scheduler is None
    metrics = getattr(scheduler, "metrics", None) if scheduler is not None else None
    if metrics is None:
        metrics = Metrics()
    lifecycle = Lifecycle(grace_s=config.graceful_shutdown_timeout)
    metrics.watch_prefix_cache(getattr(runner, "prefix_cache", None))
    if owned:
        scheduler = build_scheduler(config, runner, metrics, on_death=lifecycle.worker_died)
    max_len = max_input_length(config, runner)
    service = Service(
        runner=runner,
        scheduler=scheduler,
        metrics=metrics,
        limits=Limits(
            max_input_length=max_len,
            max_client_batch_size=config.max_client_batch_size,
            auto_truncate=config.auto_truncate,
            max_display_tokens=config.max_batch_tokens,
        ),
        permits=Permits(config.max_concurrent_requests),
        default_prompt_name=config.default_prompt_name,
        default_prompt=config.default_prompt,
        tokenization_workers=tokenization_workers(config),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        lifecycle.bind(asyncio.get_running_loop())
        if not scheduler.alive:
            scheduler.start()
        log.info(startup_line(config, runner, max_len))
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

    app = FastAPI(
        title="radixserve",
        version=routes_misc.version(),
        description="Embeddings and reranking for causal-LM models with in-batch prefix deduplication (RadixMLP).",
        lifespan=lifespan,
        docs_url=None,  # served offline by install_docs
        redoc_url=None,
    )
    app.state.service = service
    app.state.config = config
    app.state.lifecycle = lifecycle

    def on_error(kind: str) -> None:
        metrics.request_failure.labels(err=kind).inc()

    install_handlers(app, on_error=on_error)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        on_error("client_gone")
        return Response(status_code=499)  # nobody reads it: the connection is closed

    info = app.state.info = routes_misc.build_info(service, config=config, max_input_length=max_len)
    app.include_router(routes_embed.build_router(service, model_name=config.model_name))
    app.include_router(routes_rerank.build_router(service, model_name=config.model_name))
    app.include_router(routes_misc.build_router(service, info=info))
    app.include_router(routes_tei.build_router(service))
    app.include_router(routes_cohere.build_router(service))
    app.include_router(routes_openai.build_router(model_name=config.model_name))
    install_docs(app, title="radixserve")
    app.add_middleware(
        Guard, payload_limit=config.payload_limit, api_key=config.api_key, on_error=on_error,
        body_timeout_s=config.body_read_timeout,
    )
    app.add_middleware(DrainGuard, lifecycle=lifecycle)  # outside Guard: a drain answers before auth
    if config.cors_allow_origin:
        origins = ["*"] if "*" in config.cors_allow_origin else list(config.cors_allow_origin)
        app.add_middleware(  # outermost: preflights are answered without a key
            CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
            allow_headers=["content-type", "authorization"],
        )
    return app


def tokenization_workers(config: ServerConfig) -> int:
    """--tokenization-workers, else TEI's CPU cores - 1 (here at least 2: one slow body must not stall all)."""
    if config.tokenization_workers is not None:
        return config.tokenization_workers
    return max(2, min(64, (os.cpu_count() or 2) - 1))

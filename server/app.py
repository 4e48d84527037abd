"""The FastAPI app factory: wires runner, scheduler, admission, routes, errors and metrics.

``create_app(config, runner=None, scheduler=None)``: tests inject a runner and/or a scheduler;
whatever is not injected is built from ``config`` and owned by the app, which starts the
scheduler on start-up and drains it (``stop(drain=True)``) on shutdown, after uvicorn has
finished the in-flight HTTP requests. An injected scheduler is started if it is not running yet
and left to its owner to stop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request, Response

from scheduler.metrics import Metrics
from server import routes_cohere, routes_embed, routes_misc, routes_openai, routes_rerank, routes_tei
from server.admission import Guard, Permits
from server.config import ServerConfig
from server.docs import install_docs
from server.errors import install_handlers
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
    )


def build_scheduler(config: ServerConfig, runner, metrics: Metrics):
    from scheduler import Scheduler
    from scheduler.forming import PrefixPolicy

    return Scheduler(
        runner,
        max_batch_tokens=config.max_batch_tokens,
        max_batch_requests=config.max_batch_requests,
        radix_threshold=config.radix_mlp_threshold,
        metrics=metrics,
        policy=config.batching_policy,
        prefix_policy=PrefixPolicy(
            max_wait_s=config.batching_max_wait_ms / 1000.0, max_skips=config.batching_max_skips
        ),
    )


def startup_line(config: ServerConfig, runner, max_len: int) -> str:
    return (
        f"radixserve serving model={config.model_name} ({runner.model_id}) kind={runner.kind} "
        f"device={runner.device} dtype={str(runner.dtype).replace('torch.', '')} "
        f"attention_backend={runner.attention_backend} kernels={runner.kernels} "
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
    if owned:
        scheduler = build_scheduler(config, runner, metrics)
    max_len = max_input_length(config, runner)
    service = Service(
        runner=runner,
        scheduler=scheduler,
        metrics=metrics,
        limits=Limits(
            max_input_length=max_len,
            max_client_batch_size=config.max_client_batch_size,
            auto_truncate=config.auto_truncate,
        ),
        permits=Permits(config.max_concurrent_requests),
        default_prompt_name=config.default_prompt_name,
        default_prompt=config.default_prompt,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not scheduler.alive:
            scheduler.start()
        log.info(startup_line(config, runner, max_len))
        try:
            yield
        finally:
            if owned:
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
    routes_tei.document_dispatch(app, kind=runner.kind)
    # NOTE: inside Guard (added after it): POST / is dispatched after the key and size checks.
    app.add_middleware(routes_tei.RootDispatch, kind=runner.kind)
    app.add_middleware(Guard, payload_limit=config.payload_limit, api_key=config.api_key, on_error=on_error)
    return app

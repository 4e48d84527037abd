"""POST /tokenize, GET /info, GET /health and GET /metrics.

/info carries TEI's fields (model_sha, served_model_name, auto_truncate, tokenization_workers, ...)
plus ours (radix_mlp_threshold, radix_attention, batching_policy).

/health answers 200 only while the scheduler's model worker is alive, so a load balancer takes a
server with a dead worker out of rotation. /metrics renders the app's own registry (one per app).
"""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.bodies import openapi_body, parse_body
from server.errors import ApiError
from server.routes_embed import resolve_prompt
from server.schemas import SimpleToken, TokenizeRequest
from server.schemas_compat import InfoCompat
from server.service import Service


def version() -> str:
    try:
        return metadata.version("radixserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+local"


def model_type(runner) -> dict:
    """TEI-style: {"embedding": {"pooling": ...}} or {"reranker": {...}}."""
    if runner.kind == "reranker":
        return {"reranker": {"score": "sigmoid(logit('yes') - logit('no'))", "template": "qwen3-reranker"}}
    return {"embedding": {"pooling": runner.pooling}}


def build_router(service: Service, *, info: dict) -> APIRouter:
    router = APIRouter()

    @router.post(
        "/tokenize", response_model=list[list[SimpleToken]], tags=["TEI"], openapi_extra=openapi_body(TokenizeRequest)
    )
    async def tokenize(request: Request) -> Response:
        """Tokens with char offsets into the (prompt + input) string; at most max_batch_tokens
        tokens per request (422 above)."""
        service.count("tokenize")
        body = await parse_body(request, TokenizeRequest, max_items=service.limits.max_client_batch_size)
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        service.check_inputs(len(texts), empty=any(t == "" for t in texts))
        prompt = resolve_prompt(service, body.prompt_name) if service.runner.kind == "embedding" else ""
        with service.admitted(len(texts)):
            out = await service.tok.display(texts, prompt=prompt, add_special_tokens=body.add_special_tokens)
        service.metrics.request_success.labels(method="tokenize").inc()
        return Response(out, media_type="application/json")

    @router.get("/info", response_model=InfoCompat, tags=["Info"])
    async def get_info() -> dict:
        return info

    @router.get("/health", tags=["Info"])
    async def health() -> Response:
        if not service.scheduler.alive:
            raise ApiError("unhealthy", "the model worker is not running")
        return Response(status_code=200)

    @router.get("/metrics", tags=["Info"])
    async def metrics() -> Response:
        service.metrics.queue_size.set(service.scheduler.queue_size)
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router


def model_sha(model_id: str, revision: str | None, cache_dir: str | None = None) -> str | None:
    """The commit of the hub snapshot the model was loaded from (cache look-up only, offline)."""
    if Path(model_id).expanduser().is_dir():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_id, "config.json", revision=revision, cache_dir=cache_dir)
    except Exception:  # noqa: BLE001 - an id the cache cannot parse has no known commit
        return None
    if not isinstance(found, str):
        return None
    snapshot = Path(found).parent  # .../snapshots/<commit>/config.json
    return snapshot.name if snapshot.parent.name == "snapshots" else None


def build_info(service: Service, *, config, max_input_length: int) -> dict:
    runner = service.runner
    return {
        "model_id": config.model_id,
        "model_sha": model_sha(config.model_id, config.revision, config.huggingface_hub_cache),
        "served_model_name": config.model_name,
        "auto_truncate": config.auto_truncate,
        "tokenization_workers": service.tok.workers,  # the pool's real size (flag or default)
        "sha": None,
        "docker_label": None,
        "prompts": dict(runner.prompts or {}),
        "model_dtype": str(runner.dtype).replace("torch.", ""),
        "model_type": model_type(runner),
        "max_concurrent_requests": config.max_concurrent_requests,
        "max_input_length": max_input_length,
        "max_batch_tokens": config.max_batch_tokens,
        "max_batch_requests": config.max_batch_requests,
        "max_client_batch_size": config.max_client_batch_size,
        "radix_mlp_threshold": config.radix_mlp_threshold,
        "radix_attention": runner.radix_attention,
        "attention_backend": runner.attention_backend,  # which runs; why not the others:
        "attention_backend_rejected": dict(getattr(runner, "attention_rejected", {})),
        "linear": getattr(runner, "linear", "F.linear"),
        "batching_policy": config.batching_policy,
        "version": version(),
    }

"""What GET /info reports and the start-up line says: the model, its settings and the limits.

/info carries TEI's fields (model_sha, served_model_name, auto_truncate, tokenization_workers, ...)
plus ours (radix_mlp_threshold, radix_attention, attention_backend and why not the others,
tree_attention, linear, linear_choice, cpu_attention, batching_policy). Built once per app: nothing in it
changes while the server runs.
"""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

from server.config import ServerConfig
from server.service import heads
from server.service.contract import ServedRunner


def version() -> str:
    try:
        return metadata.version("radixserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+local"


def model_type(runner: ServedRunner) -> dict:
    """TEI-style: {"embedding": {...}}, {"reranker": {...}}, {"classifier": {...}}, {"reward": {...}}."""
    return heads.model_type(runner)


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


def build_info(config: ServerConfig, runner: ServedRunner, *, max_input_length: int,
               tokenization_workers: int) -> dict:
    """GET /info's body. ``tokenization_workers``: the pool's real size (flag or default)."""
    return {
        "model_id": config.model_id,
        "model_sha": model_sha(config.model_id, config.revision, config.huggingface_hub_cache),
        "served_model_name": config.model_name,
        "auto_truncate": config.auto_truncate,
        "tokenization_workers": tokenization_workers,  # per front end with --api-server-count above 1
        "api_server_count": config.api_server_count,
        "sha": None,
        "docker_label": None,
        "prompts": dict(runner.prompts or {}),
        "model_dtype": str(runner.dtype).replace("torch.", ""),
        "model_type": model_type(runner),
        "head": runner.head,  # what produces the answer: pooling, yes-no (lm_head rows), score
        "routes": list(heads.routes(runner.kind, runner.head)),  # the POST routes that run this model
        "max_concurrent_requests": config.max_concurrent_requests,
        "max_input_length": max_input_length,
        "max_batch_tokens": config.max_batch_tokens,
        "max_batch_requests": config.max_batch_requests,
        "max_client_batch_size": config.max_client_batch_size,
        "radix_mlp_threshold": config.radix_mlp_threshold,
        "radix_attention": runner.radix_attention,
        "attention_backend": runner.attention_backend,  # which runs; why not the others:
        "attention_backend_rejected": dict(runner.report.attention_rejected),
        "tree_attention": runner.tree_report,
        "linear": runner.report.linear,
        "linear_choice": runner.report.linear_choice,
        "cpu_attention": runner.report.cpu_attention,
        "memory": dict(runner.report.memory),
        "prefix_cache": dict(runner.report.prefix_cache),
        "cuda_graphs": runner.report.cuda_graphs,  # live: the warm-up fills it (models/graphs.py)
        "batching_policy": config.batching_policy,
        "startup": runner.report.startup.seconds,  # live: filled as stages end
        "version": version(),
    }


def startup_line(config: ServerConfig, runner: ServedRunner, max_input_length: int) -> str:
    """The one log line that says what this process serves, how, and on what address."""
    report = runner.report
    return (
        f"radixserve serving model={config.model_name} ({runner.model_id}) kind={runner.kind} "
        f"device={runner.device} dtype={str(runner.dtype).replace('torch.', '')} "
        f"attention_backend={runner.attention_backend} kernels={report.kernels} "
        f"linear={report.linear} cpu_weights={report.linear_choice.split(':')[0] or '-'} cpu_attention={report.cpu_attention.split(' ')[0] or '-'} "
        f"radix_mlp_threshold={config.radix_mlp_threshold} radix_attention={runner.radix_attention} "
        f"batching_policy={config.batching_policy} cuda_graphs={report.cuda_graphs.get('state', '-')!r} "
        f"max_input_length={max_input_length} max_batch_tokens={config.max_batch_tokens} "
        f"max_concurrent_requests={config.max_concurrent_requests} on {config.hostname}:{config.port}"
    )

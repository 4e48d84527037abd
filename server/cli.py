"""The ``radixserve`` console script: flags (and their env vars) -> ServerConfig -> uvicorn.

Every ServerConfig field is one flag (``max_batch_tokens`` -> ``--max-batch-tokens``); a flag
given on the command line beats its environment variable, which beats the default. Shutdown is
graceful: uvicorn stops accepting, finishes in-flight requests, then the app's lifespan drains the
scheduler.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from server.config import ServerConfig, convert, env_defaults, env_var, field_types

log = logging.getLogger("radixserve.server")

_HELP = {
    "model_id": "hub id (downloaded and cached) or local checkpoint directory",
    "revision": "hub revision",
    "served_model_name": "name reported by /info and the /v1 routes (default: the model id)",
    "hostname": "listen address",
    "port": "listen port",
    "device": "cuda, cuda:N or cpu (default: cuda if available)",
    "dtype": "float32, float16 or bfloat16 (default: bfloat16 on cuda, float32 on cpu)",
    "max_batch_tokens": "token budget of one forward",
    "max_batch_requests": "cap on items per forward",
    "max_concurrent_requests": "permits, one per input item; none left: immediate 429",
    "max_client_batch_size": "inputs per HTTP request",
    "max_input_length": "tokens per input (default: the model's max positions)",
    "auto_truncate": "truncate over-long inputs when a request does not say (true/false)",
    "radix_mlp_threshold": "use the prefix trie iff compact/original < threshold; 1 always; 0 never",
    "radix_attention": "compact or paper",
    "batching_policy": "fifo, or prefix: form batches from requests that share prefixes (with aging)",
    "batching_max_wait_ms": "prefix policy: a request waiting this long goes into the next batch first",
    "batching_max_skips": "prefix policy: a request passed over this many times goes first",
    "pooling": "last-token, mean or cls (default: from the checkpoint)",
    "default_prompt_name": "embedding prompt name (a key of the model's prompts)",
    "default_prompt": "embedding prompt text prepended to every input",
    "api_key": "require 'Authorization: Bearer KEY' on inference routes",
    "payload_limit": "bytes per request body",
    "json_output": "JSON log lines (true/false; the bare flag means true)",
    "prefix_cache_size": "cross-batch K/V cache of shared prefixes: 512MiB, 2GB, 8192tokens, auto or 0 (off)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve",
        description="Embedding and reranking server with in-batch prefix deduplication (RadixMLP). "
        "Every flag also reads its environment variable (e.g. --max-batch-tokens: MAX_BATCH_TOKENS).",
    )
    types = field_types()
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{_HELP.get(f.name, '')} [env {env_var(f.name)}; default {f.default}]"
        if types[f.name] is bool:
            # --auto-truncate false / --json-output (bare: true)
            parser.add_argument(flag, dest=f.name, nargs="?", const="true", default=None, metavar="true|false", help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text)
    return parser


def parse_config(argv: list[str] | None = None, environ=None) -> ServerConfig:
    """Defaults < environment < command line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values = env_defaults(environ)
    for name, text in vars(args).items():
        if text is None:
            continue
        try:
            values[name] = convert(name, text)
        except ValueError as exc:
            parser.error(f"--{name.replace('_', '-')}: {exc}")
    try:
        return ServerConfig(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from server.app import create_app
    from server.logs import setup_logging

    config = parse_config(argv)
    setup_logging(json_output=config.json_output)
    log.info("loading %s", config.model_id)
    try:
        app = create_app(config)
    except Exception as exc:  # noqa: BLE001 - report and exit non-zero, no traceback spam
        log.error("could not start: %s: %s", type(exc).__name__, exc)
        return 1
    uvicorn.run(
        app,
        host=config.hostname,
        port=config.port,
        log_config=None,  # keep our handlers (JSON or text)
        timeout_graceful_shutdown=30,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``radixserve`` console script: flags (and their env vars) -> ServerConfig -> the HTTP server.

The parser is generated from ServerConfig's field metadata (server/config.py): one flag per field
(``max_batch_tokens`` -> ``--max-batch-tokens``), a flag given on the command line beats its
environment variable, which beats the default. TEI's flags are fields too, so a TEI launch line
parses; the ones with no effect here say so at start. vLLM's ``radixserve serve MODEL ...`` and
Infinity's ``radixserve v2 ...`` lines are translated to ours first (server/launch_lines.py). The
flags are checked before torch or the model code is imported, so a bad line returns at once, and
so is a local checkpoint (its directory, architecture and kind against --model-task:
models/checkpoint/preflight.py). ``radixserve --version`` prints the version; ``radixserve serve
--help`` (or ``v2 --help``) prints the help and the flags that dialect's line reads.
Shutdown: see server/http/lifecycle.py. Exit status: 0 after SIGTERM/SIGINT, 1 when start-up fails,
2 for bad flags, 70 when the model worker died.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from server.config import ServerConfig, convert, env_values, env_var, field_types, flag_name
from server.launch_lines import DIALECTS, LaunchError, translate
from server.process import freeze_startup_objects, tune_switch_interval

log = logging.getLogger("radixserve.server")


class _Parser(argparse.ArgumentParser):
    """argparse with every error naming where the flags are listed (never a bare parser message)."""

    def error(self, message: str):
        if "unrecognized arguments" in message or "expected one argument" in message:
            message += (". radixserve --help lists its flags; vLLM's launch line runs as radixserve serve MODEL ..., "
                        "Infinity's as radixserve v2 ...")
        self.exit(2, f"{self.prog}: error: {message}\n")  # the one sentence, without the flag list


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="radixserve",
        description="Embedding and reranking server with in-batch prefix deduplication (RadixMLP). "
        "Every flag also reads its environment variable (e.g. --max-batch-tokens: MAX_BATCH_TOKENS); "
        "the command line wins. vLLM's line (radixserve serve MODEL --task embed ...) and Infinity's "
        "(radixserve v2 --model-id MODEL ...) are read too.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"radixserve {package_version()}")
    types = field_types()
    for f in dataclasses.fields(ServerConfig):
        meta = f.metadata
        names = [n for n in (meta["short"], flag_name(f.name), *meta["aliases"]) if n]
        help_text = meta["help"]
        if meta["choices"]:
            help_text += f" ({' | '.join(meta['choices'])})"
        if meta["inert"]:
            help_text += f"; accepted for TEI, no effect here: {meta['inert']}"
        default = "unset" if f.default is None or meta["secret"] else f.default
        help_text += f" [env {env_var(f.name)}; default {default}]"
        common = dict(dest=f.name, default=None, help=help_text)
        if types[f.name] is bool:  # --auto-truncate false / --json-output (bare: true)
            parser.add_argument(*names, nargs="?", const="true", metavar="true|false", **common)
        elif types[f.name] is tuple:
            parser.add_argument(*names, action="append", metavar="A[,B]", **common)
        else:
            parser.add_argument(*names, **common)
    return parser


def package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("radixserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+local"


def dialect_help(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """``radixserve serve --help`` / ``v2 --help``: our help, then the flags that line reads; exit 0."""
    name, table, positional = DIALECTS[argv[0]]
    parser.print_help()
    model = "MODEL (or --model)" if positional else "--model-id MODEL"
    print(f"\n{name}'s launch line, radixserve {argv[0]} {model} ...: reads {', '.join(sorted(table))}, "
          "translated to the flags above (docs/api.md, \"Command line\"); radixserve's own flags may follow.")
    parser.exit(0)


def _takes_value(parser: argparse.ArgumentParser) -> dict[str, bool | None]:
    """Each option string -> whether it takes a value (None: an optional one, the true|false flags)."""
    return {name: None if action.nargs == "?" else action.nargs != 0
            for name, action in parser._option_string_actions.items()}


def load_config(argv: list[str] | None = None, environ=None) -> tuple[ServerConfig, list[str]]:
    """Defaults < environment < command line; bad values exit with status 2. Returns warnings too."""
    parser = build_parser()
    given = sys.argv[1:] if argv is None else list(argv)
    if given and given[0] in DIALECTS and {"-h", "--help"} & set(given[1:given.index("--") if "--" in given else None]):
        dialect_help(parser, given)
    try:
        argv, notes = translate(sys.argv[1:] if argv is None else list(argv), _takes_value(parser))
    except LaunchError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    try:
        values, env_notes = env_values(environ)
        notes += env_notes
    except ValueError as exc:
        parser.error(str(exc))
    for name, text in vars(args).items():
        if text is None:
            continue
        try:
            values[name] = convert(name, text)
        except ValueError as exc:
            parser.error(f"{flag_name(name)}: {exc}")
    notes += _derive_client_batch_size(values)
    try:
        config = ServerConfig(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    notes += config.inert_flags()
    if config.revision is not None and os.path.isdir(os.path.expanduser(config.model_id)):
        notes.append(f"--revision {config.revision!r} is ignored: --model-id {config.model_id!r} is a local "
                     "directory, served as it is")
    if config.hf_api_token is not None:
        notes.append("--hf-api-token (HF_API_TOKEN) is deprecated, as in TEI: use --hf-token (HF_TOKEN)")
    return config, notes


def _derive_client_batch_size(values: dict) -> list[str]:
    """Permits fewer than the default client batch size, and no client batch size given: the
    largest request is the permits (TEI's launch lines set 512 permits alone). Only a client batch
    size the user gave can contradict the permits (ServerConfig refuses that)."""
    permits = values.get("max_concurrent_requests")
    default = ServerConfig.__dataclass_fields__["max_client_batch_size"].default
    if "max_client_batch_size" in values or permits is None or permits >= default:
        return []
    values["max_client_batch_size"] = permits
    return [f"--max-client-batch-size set to {permits} (--max-concurrent-requests; the default {default} "
            "could never be admitted); set it to choose another value up to the permits"]


def parse_config(argv: list[str] | None = None, environ=None) -> ServerConfig:
    return load_config(argv, environ)[0]


def export_hub_settings(config: ServerConfig, environ=None) -> None:
    """Hand --hf-token and --huggingface-hub-cache to huggingface_hub, which reads them from the
    environment when it is first imported (so this runs before any model code)."""
    env = os.environ if environ is None else environ
    if config.hub_token:
        env["HF_TOKEN"] = config.hub_token
    if config.huggingface_hub_cache:
        env["HF_HUB_CACHE"] = env["HUGGINGFACE_HUB_CACHE"] = config.huggingface_hub_cache
    if "huggingface_hub" in sys.modules and (config.hub_token or config.huggingface_hub_cache):
        log.warning("huggingface_hub was imported before the hub settings were applied")


def metrics_listener(config: ServerConfig, app) -> list:
    """The --prometheus-port listener as a side server of the API's (none when the flag is unset)."""
    from server.http import listener

    if config.prometheus_port is None:
        return []
    host = config.prometheus_hostname or config.hostname
    sock = listener.bind_sockets(hostname=host, port=config.prometheus_port, uds_path=None)[0]
    service = app.state.service
    log.info("metrics also served on http://%s:%d/metrics", host, config.prometheus_port)
    return [listener.metrics_server(
        service.metrics.registry, sock=sock, stack=config.http_stack, header_timeout_s=config.header_read_timeout,
        on_scrape=lambda: service.metrics.queue_size.set(service.scheduler.queue_size),
        healthy=lambda: service.scheduler.alive and not app.state.lifecycle.draining)]


def serve_engine(config: ServerConfig, runner) -> int:
    """--api-server-count above 1: this process runs the model behind N front ends, then exits."""
    from server.frontends.engine import serve

    freeze_startup_objects()
    code = serve(config, runner)
    log.info("exiting with status %d", code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as below: no interpreter finalization of the loaded model


BATCH_COMMANDS = ("batch", "run-batch")  # `radixserve batch ...` (vLLM: `vllm run-batch ...`)


def preflight(config: ServerConfig) -> str | None:
    """Why the checkpoint cannot be served as asked, read without torch (None: load it). A hub id
    not in the hub cache yet is checked when it is loaded."""
    from models.checkpoint.preflight import local_dir, served_kind

    try:
        model_dir = local_dir(config.model_id, config.revision)
        if model_dir is not None:
            config.check_kind(served_kind(model_dir, config.load_kind, config.rerank_template))
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    from models.startup import note_entry

    note_entry()  # this program's start, before any child runs (models/startup.py)
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in BATCH_COMMANDS:  # an offline job over the same app: server/batch
        from server.batch.command import main as batch_main

        return batch_main(args[1:])
    config, notes = load_config(argv)  # before torch and the model code: a bad flag returns at once
    from server.allocator import apply_image_settings

    apply_image_settings(reexec=argv is None)  # the images' allocator settings, before torch loads
    from server.http.logs import setup_logging

    setup_logging(json_output=config.json_output)
    for note in notes:
        log.warning(note)
    export_hub_settings(config)
    refusal = preflight(config)  # a checkpoint that cannot serve as asked: refused before torch loads
    if refusal is not None:
        log.error("could not start: %s", refusal)
        return 1
    from server.app import create_app, load_runner
    from server.http import listener, tracing
    from server.http.access_log import AccessLog

    tune_switch_interval()
    from models.startup import begin_process

    clock = begin_process()  # launch to healthy per stage: the log and /info's `startup`
    clock.mark("import")
    log.info("loading %s", config.model_id)
    try:
        runner = load_runner(config)
        config.check_kind(runner.kind)
        if config.api_server_count > 1:  # front-end processes before this one: server/frontends
            return serve_engine(config, runner)
        app = create_app(config, runner=runner)
        sockets = listener.bind_sockets(hostname=config.hostname, port=config.port, uds_path=config.uds_path)
        side = metrics_listener(config, app)
    except Exception as exc:  # noqa: BLE001 - report and exit non-zero, no traceback spam
        log.error("could not start: %s: %s", type(exc).__name__, exc)
        return 1
    clock.mark("app")
    freeze_startup_objects()
    clock.mark("freeze")  # the warm-up runs on the worker thread when the app starts, then the total
    lifecycle = app.state.lifecycle
    served = AccessLog(tracing.instrument(app, endpoint=config.otlp_endpoint, service_name=config.otlp_service_name))
    uv_config = listener.uvicorn_config(
        served,
        stack=config.http_stack,
        header_timeout_s=config.header_read_timeout,
        max_connections=config.max_connections,
        log_config=None,  # keep our handlers (JSON or text)
        # NOTE: the Lifecycle drains first; uvicorn then only closes the (answered) connections.
        timeout_graceful_shutdown=max(0.1, lifecycle.margin_s / 4),
        lifespan="on",
    )
    where = f"http://{config.hostname}:{config.port}" + (f" and unix:{config.uds_path}" if config.uds_path else "")
    log.info("listening on %s (HTTP stack: %s)", where, listener.resolve_stack(config.http_stack))
    try:
        listener.DrainingServer(uv_config, lifecycle, side=side).run(sockets=sockets)
    finally:
        for sock in [*sockets, *(s for _, socks in side for s in socks)]:
            sock.close()
        if config.uds_path and os.path.exists(config.uds_path):
            os.unlink(config.uds_path)
    log.info("exiting with status %d", lifecycle.exit_code)
    # NOTE: skip the interpreter's finalization: tearing down the loaded tokenizer and model can
    # take seconds, even for the tiny test fixture, time the shutdown budget does not have, and a
    # forward that outlived the drain would hold it longer. Everything is answered and closed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(lifecycle.exit_code)

if __name__ == "__main__":
    sys.exit(main())

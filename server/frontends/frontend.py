"""One front-end process: ``python -m server.frontends.frontend IPC_FD TCP_FD [UDS_FD]``.

Started by the engine (engine.py) with the descriptors inherited: its end of the socket pair to
the engine and its own listening socket on the API port (plus the shared unix socket of
--uds-path). It reads the engine's hello (the config, a ``RunnerView``, its index), builds the
ordinary app on them (``create_app`` with a ``RemoteScheduler``), so every route, check, limit,
auth and drain rule is the single-process one, and serves until SIGTERM (a drain, exit 0) or the
engine's end (a drain, exit ``EXIT_WORKER_DEAD``). Two things differ: /metrics answers the sum
over every process, and each answer names the front end in ``x-radixserve-frontend``.
"""
from __future__ import annotations

import logging
import os
import socket
import sys

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.frontends import metrics_merge, wire
from server.frontends.remote import RemoteScheduler

log = logging.getLogger("radixserve.server")

HEADER = b"x-radixserve-frontend"


class FrontendHeader:
    """ASGI middleware: every answer carries this front end's index (which process served it)."""

    def __init__(self, app, *, index: int) -> None:
        self.app = app
        self.value = str(index).encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, self.value)]}
            await send(message)

        await self.app(scope, receive, tagged)


def aggregate_metrics(app: FastAPI, remote: RemoteScheduler) -> None:
    """Answer /metrics with the sum over every process, gathered by the engine: a route matched
    before the app's own (routes match in order), which stays in the OpenAPI schema."""

    async def metrics() -> Response:
        families = await remote.scrape()
        return Response(metrics_merge.exposition(families), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.router.routes.insert(0, app.router.routes.pop())


def main(argv: list[str]) -> int:
    ipc = socket.socket(fileno=int(argv[0]))
    listening = [socket.socket(fileno=int(fd)) for fd in argv[1:]]
    hello = wire.recv_sync(ipc)[1]
    config, view, index = hello["config"], hello["view"], hello["index"]
    from scheduler.metrics import Metrics
    from server.app import create_app
    from server.process import freeze_startup_objects
    from server.http import listener, tracing
    from server.http.access_log import AccessLog
    from server.http.connections import paced
    from server.http.logs import setup_logging

    setup_logging(json_output=config.json_output)
    remote = RemoteScheduler(ipc, metrics=Metrics(), engine_alive=hello["alive"])
    remote.startup = view.startup_seconds  # the dict /info answers, updated in place
    app = create_app(config, runner=view, scheduler=remote)
    lifecycle = app.state.lifecycle
    remote.on_death = lifecycle.worker_died
    aggregate_metrics(app, remote)
    app.add_middleware(FrontendHeader, index=index)
    sockets = paced(listening)
    freeze_startup_objects()
    served = AccessLog(tracing.instrument(app, endpoint=config.otlp_endpoint, service_name=config.otlp_service_name))
    uv_config = listener.uvicorn_config(
        served, stack=config.http_stack, header_timeout_s=config.header_read_timeout,
        max_connections=config.max_connections, log_config=None,
        timeout_graceful_shutdown=max(0.1, lifecycle.margin_s / 4), lifespan="on",
    )
    log.info("front end %d (pid %d) serving", index, os.getpid())
    try:
        listener.DrainingServer(uv_config, lifecycle).run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
    log.info("front end %d exiting with status %d", index, lifecycle.exit_code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(lifecycle.exit_code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

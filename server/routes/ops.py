"""Operations routes: GET /info, GET /health, GET /metrics and vLLM's GET /version.

/info answers the dict built once at start-up (server/service/info.py). /health answers 200 only
while the scheduler's model worker is alive, so a load balancer takes a server with a dead worker
out of rotation; on a front end (--api-server-count above 1) only while the engine process also
answers a ping within PING_TIMEOUT_S (server/frontends/remote.py): a stopped or stuck engine is
unhealthy too. /metrics renders the app's own registry (one per app).
"""
from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.http.errors import ApiError
from server.schemas.tei import InfoCompat
from server.service.core import Service


class OpsRoutes:
    """The operations handlers of one app."""

    def __init__(self, service: Service, *, info: dict) -> None:
        self.service = service
        self.info = info

    async def get_info(self) -> dict:
        return self.info

    async def get_version(self) -> dict:
        """vLLM's /version: {"version": radixserve's version}."""
        return {"version": self.info["version"]}

    async def health(self) -> Response:
        self.service.check_alive()
        ping = getattr(self.service.scheduler, "ping", None)  # a front end's: the engine's own word
        if ping is not None and not await ping():
            raise ApiError("unhealthy", "the engine process did not answer a health check in time, or its "
                                        "model worker is not running")
        return Response(status_code=200)

    async def metrics(self) -> Response:
        self.service.metrics.queue_size.set(self.service.scheduler.queue_size)
        return Response(self.service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def build_router(service: Service, *, info: dict) -> APIRouter:
    ops = OpsRoutes(service, info=info)
    router = APIRouter()
    router.add_api_route("/info", ops.get_info, methods=["GET"], response_model=InfoCompat, tags=["Info"])
    router.add_api_route("/health", ops.health, methods=["GET"], tags=["Info"])
    router.add_api_route("/version", ops.get_version, methods=["GET"], tags=["Info"], summary="Version (vLLM)")
    router.add_api_route("/metrics", ops.metrics, methods=["GET"], tags=["Info"])
    return router

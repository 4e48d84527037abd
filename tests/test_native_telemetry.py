"""FastAPI's own request telemetry stays off (server/http/tracing.py ``native_telemetry_off``):
with an OpenTelemetry tracer provider set, as --otlp-endpoint sets one, the app asks it for no
tracer, so each request is traced once (by the server's own middleware) and still takes the
express lane. In a subprocess: a process sets its global tracer provider once."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import asyncio, json, sys
import httpx
from opentelemetry import trace
from opentelemetry.trace import NoOpTracer, TracerProvider

asked = []


class Recording(TracerProvider):
    def get_tracer(self, *args, **kwargs):
        asked.append(args[0] if args else "")
        return NoOpTracer()


trace.set_tracer_provider(Recording())
import models
from server.app import create_app
from server.config import ServerConfig

runner = models.load_runner(sys.argv[1], device="cpu", dtype="float32")
app = create_app(ServerConfig(model_id=sys.argv[1], served_model_name="tiny"), runner=runner)


async def main():
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            health = await c.get("/health")
            embed = await c.post("/v1/embeddings", json={"input": "a query", "model": "tiny"})
    return health.status_code, embed.status_code, len(embed.json()["data"][0]["embedding"])


codes = asyncio.run(main())
print(json.dumps({"codes": codes, "asked": asked}))
"""


def test_fastapi_asks_a_set_tracer_provider_for_nothing(tiny_embedding_dir):
    pytest.importorskip("opentelemetry.trace", reason="opentelemetry-api is not installed")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_embedding_dir)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["codes"][:2] == [200, 200] and out["codes"][2] > 0
    assert out["asked"] == []

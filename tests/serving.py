"""Tests' server helper: an app under a real uvicorn server on a free loopback port, in a thread.

For tests that need real HTTP (the OpenAI SDK, concurrent httpx clients, client
disconnects). The invariant: ``stop()`` goes through uvicorn's graceful shutdown, so the app's
lifespan shutdown (scheduler drain) runs exactly as it does under the CLI.
"""
from __future__ import annotations

import functools
import socket
import threading
import time

import uvicorn


@functools.lru_cache(maxsize=4)
def cached_runner(model_dir: str):
    """One fp32 CPU runner per checkpoint per process (loading the tokenizer takes seconds)."""
    import models

    return models.load_runner(model_dir, device="cpu", dtype="float32")


def serve(model_dir, **overrides) -> "ServerThread":
    """A started server for `model_dir` on ``cached_runner``, ServerConfig fields overridden."""
    from server.app import create_app
    from server.config import ServerConfig

    config = ServerConfig(model_id=str(model_dir), **overrides)
    return ServerThread(create_app(config, runner=cached_runner(str(model_dir)))).start()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_stacks() -> list:
    """pytest params of the HTTP stacks to test on: h11 always, httptools (skipped when absent)."""
    import pytest

    try:
        import httptools  # noqa: F401
        import uvloop  # noqa: F401
        have = True
    except ImportError:
        have = False
    return ["h11", pytest.param("httptools", marks=pytest.mark.skipif(not have, reason="httptools/uvloop not installed"))]


class ServerThread:
    """``with ServerThread(app) as srv: httpx.get(srv.url + "/health")``.

    ``stack``: run the CLI's listener stack (server.http.listener: our protocol, head timeout
    ``header_timeout_s``) on that HTTP stack; None: uvicorn's defaults.
    """

    def __init__(self, app, *, port: int | None = None, startup_timeout: float = 600.0, stack: str | None = None,
                 header_timeout_s: float = 10.0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        common = dict(host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        if stack is None:
            config = uvicorn.Config(app, **common)
        else:
            from server.http.listener import uvicorn_config

            config = uvicorn_config(app, stack=stack, header_timeout_s=header_timeout_s, **common)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.startup_timeout = startup_timeout

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start in time")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

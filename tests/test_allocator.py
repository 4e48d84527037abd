"""The Docker images preload jemalloc and cap oneDNN's primitive caches: the server must run so.

A real server process started with the CPU image's memory settings (LD_PRELOAD, LRU_CACHE_CAPACITY,
ONEDNN_PRIMITIVE_CACHE_CAPACITY, read from the Dockerfile) maps jemalloc, answers /health, and
embeds what an in-process server (glibc malloc, default caches) embeds. Skips where Debian's
libjemalloc2 is not installed.
"""
from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = "libjemalloc.so.2"  # the Dockerfile's value
TEXTS = ["a shared instruction: represent this passage", "a shared instruction: and this one, longer"]


def _jemalloc_or_skip() -> None:
    # NOTE: found, not dlopen-ed: jemalloc's static TLS only fits when it is preloaded at exec.
    if ctypes.util.find_library("jemalloc") != PRELOAD:
        pytest.skip("jemalloc not installed (Debian: apt-get install libjemalloc2)")


def _wait_healthy(url: str, proc: subprocess.Popen, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


def test_server_runs_under_the_images_jemalloc_preload(tiny_embedding_dir):
    _jemalloc_or_skip()
    from server.app import create_app
    from server.config import ServerConfig
    from tests.serving import ServerThread, cached_runner, free_port

    with ServerThread(create_app(ServerConfig(model_id=str(tiny_embedding_dir)),
                                 runner=cached_runner(str(tiny_embedding_dir)))) as srv:
        expected = np.array(httpx.post(srv.url + "/embed", json={"inputs": TEXTS}).json())

    from tests.test_deploy import dockerfile_stages, env_of

    image_env = env_of(next(st for st in dockerfile_stages((ROOT / "Dockerfile").read_text()) if st["name"] == "cpu"))
    memory_env = {k: image_env[k] for k in ("LD_PRELOAD", "MALLOC_CONF", "LRU_CACHE_CAPACITY",
                                            "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    assert memory_env["LD_PRELOAD"] == PRELOAD and "background_thread:true" in memory_env["MALLOC_CONF"]
    port = free_port()
    env = {**os.environ, **memory_env}
    argv = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())",
            "--model-id", str(tiny_embedding_dir), "--hostname", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libjemalloc" in maps  # the preload took: malloc is jemalloc's in the server
        # ... and jemalloc read MALLOC_CONF: its purging thread runs (a typo'd option would not start it)
        threads = [(t / "comm").read_text().strip() for t in Path(f"/proc/{proc.pid}/task").iterdir()]
        assert any(name.startswith("jemalloc_bg_thd") for name in threads), threads
        got = np.array(httpx.post(url + "/embed", json={"inputs": TEXTS}, timeout=30).json())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)

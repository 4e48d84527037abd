"""Under an address space of its idle size + 256 MiB (the container case), every route's largest
admitted request is answered 200, 413 or 503 and the process lives.

Each server is started once to read its idle VmSize (after it is healthy and has served a small
request), then restarted under ``prlimit --as`` at that + 256 MiB, so the memory budget sees the
limit from the start (server/memory.py). The largest admitted requests, at the limits the server is
started with: as many inputs as --max-client-batch-size, each at the input limit; a /predict pair
of 1.0M + 0.95M digits; /score with a distinct text_1 per text_2; two concurrent maximum /embed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

import fixtures
from server.memory import MIB
from tests.serving import free_port
from tests.test_allocator import _wait_healthy

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")]

ROOT = Path(__file__).resolve().parents[1]
ITEMS, MAX_INPUT = 256, 512
# answered, and the process lives: served, too large ever (413), the budget held by the other
# request of a concurrent pair now (429, docs/api.md: retry later), or no memory for this one (503)
ANSWERED = (200, 413, 429, 503)


def _vm_size(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


def _start(model_dir: str, cap: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())",
            "--model-id", model_dir, "--hostname", "127.0.0.1", "--port", str(port),
            "--max-client-batch-size", str(ITEMS), "--max-input-length", str(MAX_INPUT)]
    if cap is not None:
        argv = ["prlimit", f"--as={cap}", "--"] + argv
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc, limit_s=600)
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _under_limit(model_dir: str, warm: tuple[str, dict], requests: list[tuple[str, dict, int]]) -> None:
    proc, url = _start(model_dir, None)
    try:
        assert httpx.post(url + warm[0], json=warm[1], timeout=120).status_code == 200
        cap = _vm_size(proc.pid) + 256 * MIB
    finally:
        _stop(proc)
    proc, url = _start(model_dir, cap)
    try:
        httpx.post(url + warm[0], json=warm[1], timeout=120)
        for path, body, concurrent in requests:
            codes: list = []

            def one() -> None:
                try:
                    codes.append(httpx.post(url + path, json=body, timeout=900).status_code)
                except httpx.HTTPError as exc:  # the process died under it: reported below
                    codes.append(type(exc).__name__)

            threads = [threading.Thread(target=one) for _ in range(concurrent)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert proc.poll() is None, (path, proc.stderr.read()[-3000:])
            assert all(c in ANSWERED for c in codes), (path, codes)
            assert httpx.get(url + "/health", timeout=60).status_code == 200
    finally:
        _stop(proc)


def _texts(n: int, words: int) -> list[str]:
    return [f"{i} " + "lorem ipsum dolor sit amet " * words for i in range(n)]


def test_classifier_pairs(fixture_root):
    model = str(fixtures.cached("tiny-qwen3-seq-cls-3", root=fixture_root))
    _under_limit(model, ("/predict", {"inputs": "warm"}), [
        ("/predict", {"inputs": ["1" * 1_000_000, "2" * 950_000], "truncate": True}, 1),
        ("/predict", {"inputs": [[t, t] for t in _texts(ITEMS, 60)], "truncate": True}, 1),
        ("/classify", {"input": _texts(ITEMS, 120)}, 1),
    ])


def test_reranker_rerank_and_score(fixture_root):
    model = str(fixtures.cached("tiny-reranker", root=fixture_root))
    docs = _texts(ITEMS, 120)
    _under_limit(model, ("/rerank", {"query": "q", "texts": ["warm"]}), [
        ("/rerank", {"query": "7" * 1_900_000, "texts": docs[:64], "truncate": True}, 1),
        ("/rerank", {"query": "what is it", "texts": docs, "truncate": True}, 1),
        ("/score", {"text_1": [f"query {i}" for i in range(ITEMS)], "text_2": docs}, 1),
    ])


def test_embedding_routes(fixture_root):
    model = str(fixtures.cached("tiny-embedding", root=fixture_root))
    big = {"inputs": _texts(ITEMS, 120), "truncate": True}
    _under_limit(model, ("/embed", {"inputs": "warm"}), [
        ("/embed", big, 2),  # two at once: the SIGABRT
        ("/embed_all", {"inputs": _texts(8, 120), "truncate": True}, 1),
        ("/embed", {"inputs": "1" * 1_900_000, "truncate": True}, 1),
    ])

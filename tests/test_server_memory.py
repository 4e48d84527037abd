"""No request can exhaust the server's memory.

- ``MemoryBudget``: the limit less the baseline and a headroom; 413 for a request that can never
  fit (naming the limit), 429 while others hold the rest, everything given back.
- The limit is found in the cgroup (v2, v1) and ``ulimit -v``; the smallest limit wins.
- A real server process whose address space is capped a little above what it uses idle
  (``prlimit``) answers the hostile bodies (1.9M digits to truncate, ``"word " * 4000`` on
  /embed_all, a huge rerank query, ...) with 2xx/4xx/503 and keeps serving.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server import memory
from server.http.errors import ApiError
from server.memory import MIB, MemoryBudget
from tests.serving import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_a_cpu_forward_keeps_a_full_batch_of_activations_out_of_the_budget():
    # Qwen3-0.6B's widths at 16384 tokens, fp32: 16384 x 4 x 6 x (1024 + 3072) bytes = 1536 MiB
    acts = memory.activation_bytes(tokens=16384, hidden=1024, intermediate=3072, dtype_bytes=4)
    assert acts == 1536 * MIB
    budget = MemoryBudget(4000 * MIB, source="--memory-limit", baseline=1000 * MIB, activations=acts)
    assert budget.total == 3000 * MIB - acts - memory.ALLOCATOR_SLACK  # more than a quarter of 3000
    assert MemoryBudget(4000 * MIB, baseline=1000 * MIB, activations=MIB).total == 2250 * MIB  # the quarter
    assert MemoryBudget(100 * MIB).total == 100 * MIB - memory.MIN_HEADROOM  # no activations: the floor


def test_budget_refuses_what_can_never_fit_and_what_does_not_fit_now():
    budget = MemoryBudget(1000 * MIB, source="--memory-limit", baseline=200 * MIB)
    assert budget.total == 600 * MIB  # 800 left, a quarter kept as headroom
    with pytest.raises(ApiError) as info:
        with budget.reserved(601 * MIB, what="x"):
            pass
    assert info.value.status == 413 and "--memory-limit" in info.value.message and "1000 MiB" in info.value.message
    with budget.reserved(400 * MIB, what="a"):
        with pytest.raises(ApiError) as busy:
            with budget.reserved(201 * MIB, what="b"):
                pass
        assert busy.value.status == 429
        with budget.reserved(200 * MIB, what="c"):
            assert budget.in_use == 600 * MIB
    assert budget.in_use == 0
    unlimited = MemoryBudget(None)
    with unlimited.reserved(1 << 50, what="anything"):
        pass


def test_limits_are_found_and_the_smallest_wins(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("max\n")
    assert memory.cgroup_limit(str(tmp_path)) is None
    (tmp_path / "memory.max").write_text("123456789\n")
    assert memory.cgroup_limit(str(tmp_path)) == 123456789
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(1 << 63 - 1) + "\n")  # v1's "no limit"
    assert memory.cgroup_limit(str(v1)) is None
    monkeypatch.setattr(memory, "cgroup_limit", lambda: 5 * MIB)
    monkeypatch.setattr(memory, "address_space_limit", lambda: 7 * MIB)
    assert memory.detect_limit(None) == (5 * MIB, "the cgroup memory limit")
    assert memory.detect_limit(3 * MIB) == (3 * MIB, "--memory-limit")


def test_a_request_over_the_budget_is_413_and_the_server_serves_on(tiny_embedding_dir):
    from server.app import create_app
    from server.config import ServerConfig
    from tests.serving import ServerThread, cached_runner

    app = create_app(ServerConfig(model_id=str(tiny_embedding_dir), max_batch_tokens=4096),
                     runner=cached_runner(str(tiny_embedding_dir)))
    with ServerThread(app) as srv:
        service = app.state.service
        hidden = service.runner.hidden_size
        small = memory.estimate(tokens=64, answer_floats=64 * hidden)
        service.memory = MemoryBudget(memory.MIN_HEADROOM + 3 * small, source="--memory-limit")  # total: 3 x small
        r = httpx.post(srv.url + "/embed_all", json={"inputs": ["word " * 4000], "truncate": True}, timeout=60)
        assert r.status_code == 413 and "--memory-limit" in r.json()["error"], r.text
        ok = httpx.post(srv.url + "/embed", json={"inputs": "word " * 10}, timeout=60)
        assert ok.status_code == 200 and service.memory.in_use == 0


def test_an_allocation_that_fails_fails_only_its_request(tiny_embedding_dir, monkeypatch):
    from server.app import create_app
    from server.config import ServerConfig
    from tests.serving import ServerThread, cached_runner

    app = create_app(ServerConfig(model_id=str(tiny_embedding_dir)), runner=cached_runner(str(tiny_embedding_dir)))
    service = app.state.service
    shaped = service._shaped

    async def out_of_memory(*args, **kw):
        raise MemoryError()

    with ServerThread(app) as srv:
        monkeypatch.setattr(service, "_shaped", out_of_memory)
        r = httpx.post(srv.url + "/embed", json={"inputs": "x"}, timeout=60)
        assert r.status_code == 503 and "memory" in r.json()["error"] and r.headers["retry-after"], r.text
        monkeypatch.setattr(service, "_shaped", shaped)
        assert httpx.post(srv.url + "/embed", json={"inputs": "x"}, timeout=60).status_code == 200
        assert service.memory.in_use == 0 and service.permits.in_use == 0


def _vm_size(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


HOSTILE = [
    ("/embed", {"inputs": "1" * 1_900_000, "truncate": True}),
    ("/embed_all", {"inputs": ["word " * 4000], "truncate": True}),
    ("/embed", {"inputs": "1" * 1_900_000, "truncate": False}),
    ("/embed", {"inputs": ["word " * 2000] * 64, "truncate": True}),
    ("/tokenize", {"inputs": "1" * 1_900_000}),
    ("/embed_all", {"inputs": ["a" * 1_500_000], "truncate": True, "truncation_direction": "Left"}),
]


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs Linux prlimit")
def test_process_under_an_address_space_limit_survives_hostile_bodies(tiny_embedding_dir):
    """Capped at its idle address space + 256 MiB (the issue's margin), it answers every hostile
    body without dying, and answers /health and a normal request afterwards."""
    port = free_port()
    argv = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())",
            "--model-id", str(tiny_embedding_dir), "--hostname", "127.0.0.1", "--port", str(port),
            "--max-batch-tokens", "4096", "--prefix-cache-size", "0"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        from tests.test_allocator import _wait_healthy

        _wait_healthy(url, proc)
        httpx.post(url + "/embed", json={"inputs": ["warm the pools", "and the threads"]}, timeout=60)
        cap = _vm_size(proc.pid) + 256 * MIB
        resource.prlimit(proc.pid, resource.RLIMIT_AS, (cap, cap))
        for path, body in HOSTILE:
            r = httpx.post(url + path, json=body, timeout=120)
            assert r.status_code in (200, 413, 422, 429, 503), (path, r.status_code, r.text[:300])
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert httpx.get(url + "/health", timeout=30).status_code == 200
        ok = httpx.post(url + "/embed", json={"inputs": "still serving"}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()

"""Real radixserve processes (`python -m server.cli`, or tests/fault_server.py's wrapper of it): SIGTERM drains in-flight work and answers the rest with a
JSON 503 within --graceful-shutdown-timeout; a dead model worker makes the process exit non-zero;
slow request heads and bodies are cut off while keep-alive still works; the unix socket, the
Prometheus listener and CORS of TEI's flags. Faults come from tests/fault_server.py (RADIXSERVE_TEST_FAULT)."""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.http.lifecycle import EXIT_WORKER_DEAD, RETRY_AFTER_S
from tests import fault_server
from tests.serving import free_port, http_stacks

ROOT = Path(__file__).resolve().parents[1]


class Proc:
    """A radixserve process on a free loopback port; ``stop()`` returns (returncode, output)."""

    def __init__(self, model_dir, *flags: str, fault: str = "", env: dict | None = None,
                 open_files: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), RADIXSERVE_TEST_FAULT=fault, **(env or {}))
        for key in ("API_KEY", "HOSTNAME", "PORT"):
            env.pop(key, None)
        entry = "tests.fault_server" if fault else "server.cli"
        cmd = [sys.executable, "-m", entry, "--model-id", str(model_dir), "--hostname", "127.0.0.1",
               "-p", str(self.port), "--max-batch-tokens", "512", *flags]
        limit = None if open_files is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files)))
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=limit)
        deadline = time.monotonic() + 600  # catches a hang only: a busy 2-core box took minutes
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)

    def wait(self, timeout: float) -> tuple[int, str]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
        return self.proc.returncode, out


def _post_in_thread(url: str, results: dict, key: str, **kw) -> threading.Thread:
    def go():
        try:
            results[key] = httpx.post(url, timeout=60, **kw)
        except httpx.HTTPError as exc:  # pragma: no cover - reported by the assertion below
            results[key] = exc

    t = threading.Thread(target=go)
    t.start()
    return t


@pytest.mark.parametrize("stack", http_stacks())
def test_sigterm_drains_then_503s_what_is_left_and_exits_in_time(tiny_embedding_dir, stack):
    # Each forward takes 2 s and holds one item. In-flight requests may finish until
    # grace - margin = 3 - 0.6 = 2.4 s after the signal (sent ~0.6 s after A): A ends ~2 s after
    # it was sent, well inside; B cannot start before ~2 s nor end before ~4 s, well outside.
    srv = Proc(tiny_embedding_dir, "--graceful-shutdown-timeout", "3", "--max-batch-requests", "1", "--json-output",
               "--http-stack", stack,
               fault="slow_forward=2.0", env={"RADIX_MLP_THRESHOLD": "1.0", "MAX_CLIENT_BATCH_SIZE": "7"})
    try:
        info = httpx.get(srv.url + "/info").json()  # flags and env vars reach the app
        assert info["max_client_batch_size"] == 7 and info["radix_mlp_threshold"] == 1.0
        assert info["max_batch_tokens"] == 512 and info["max_input_length"] == 512
        results: dict = {}
        a = _post_in_thread(srv.url + "/embed", results, "a", json={"inputs": "first"})
        time.sleep(0.3)
        b = _post_in_thread(srv.url + "/v1/embeddings", results, "b", json={"input": "second"})
        time.sleep(0.3)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        new = httpx.post(srv.url + "/embed", json={"inputs": "late"}, timeout=10)
        health = httpx.get(srv.url + "/health", timeout=10)
        a.join(30), b.join(30)
        code, out = srv.wait(timeout=600)
        elapsed = time.monotonic() - t0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert new.status_code == 503 and new.headers["retry-after"] == str(RETRY_AFTER_S)
    assert new.json()["error_type"] == "Unhealthy"
    assert health.status_code == 503
    assert results["a"].status_code == 200 and len(results["a"].json()) == 1, out
    b_resp = results["b"]
    assert b_resp.status_code == 503 and b_resp.headers["content-type"] == "application/json", b_resp.text
    assert b_resp.json()["error"]["code"] == "service_unavailable" and b_resp.headers["retry-after"]
    assert code == 0, out
    # B's 503 shows the grace was enforced; the bound only catches a drain that hangs
    assert elapsed < 60, (elapsed, out)
    assert "Internal Server Error" not in out and "timeout graceful shutdown exceeded" not in out
    messages = [json.loads(line)["message"] for line in out.splitlines() if line.startswith("{")]
    start = next(m for m in messages if m.startswith("radixserve serving"))
    for part in ("kind=embedding", "device=cpu", "dtype=float32", "attention_backend=", "kernels=",
                 "radix_mlp_threshold=1.0", "radix_attention=compact"):
        assert part in start, start
    assert any(m.startswith("draining (received SIGTERM)") for m in messages)
    assert "Application shutdown complete." in messages


def test_dead_worker_exits_non_zero(tiny_embedding_dir):
    srv = Proc(tiny_embedding_dir, fault="die_on_forward=2")
    try:
        ok = httpx.post(srv.url + "/embed", json={"inputs": "fine"}, timeout=30)
        dead = httpx.post(srv.url + "/embed", json={"inputs": "fatal"}, timeout=30)
        code, out = srv.wait(timeout=600)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert ok.status_code == 200
    assert dead.status_code == 503 and dead.json()["error_type"] == "Unhealthy"
    assert code == EXIT_WORKER_DEAD, out
    assert "the model worker died" in out


def test_a_cuda_fault_answers_503_fails_health_and_exits_non_zero(tiny_embedding_dir):
    # Forward 2 runs 0.5 s, then raises what torch raises on an illegal memory access.
    srv = Proc(tiny_embedding_dir, "--max-batch-requests", "1", "--graceful-shutdown-timeout", "6",
               "--body-read-timeout", "30", fault="slow_forward=0.5,cuda_error_on_forward=2:illegal")
    results: dict = {}
    try:
        ok = httpx.post(srv.url + "/embed", json={"inputs": "fine"}, timeout=30)
        # A client still sending its body keeps the drain open, so /health can be read meanwhile.
        slow = socket.create_connection(("127.0.0.1", srv.port))
        slow.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 40\r\n\r\n{\"inputs\"")
        faulted = _post_in_thread(srv.url + "/embed", results, "faulted", json={"inputs": "fault"})
        time.sleep(0.2)
        queued = _post_in_thread(srv.url + "/embed", results, "queued", json={"inputs": "behind it"})
        faulted.join(30)
        queued.join(30)
        health = httpx.get(srv.url + "/health", timeout=5)
        slow.close()
        code, out = srv.wait(timeout=600)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert ok.status_code == 200
    for key in ("faulted", "queued"):  # what was pending: a JSON 503, not a 500 a retry would hit again
        r = results[key]
        assert r.status_code == 503 and r.json()["error_type"] == "Unhealthy", (key, r.text)
    assert health.status_code == 503
    assert code == EXIT_WORKER_DEAD, out
    assert "device fault at run: AcceleratorError: CUDA error: an illegal memory access" in out
    assert "the model worker died" in out


def test_out_of_memory_fails_its_batch_and_the_server_keeps_serving(tiny_embedding_dir):
    srv = Proc(tiny_embedding_dir, fault="cuda_error_on_forward=2:oom")
    try:
        before = httpx.post(srv.url + "/embed", json={"inputs": "fine"}, timeout=30)
        oom = httpx.post(srv.url + "/embed", json={"inputs": "too big"}, timeout=30)
        after = httpx.post(srv.url + "/embed", json={"inputs": "fine again"}, timeout=30)
        health = httpx.get(srv.url + "/health", timeout=5)
        metrics = httpx.get(srv.url + "/metrics", timeout=5).text
        srv.proc.send_signal(signal.SIGTERM)
        code, out = srv.wait(timeout=600)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert before.status_code == 200 and after.status_code == 200 and health.status_code == 200
    assert oom.status_code == 500 and "out of memory" not in oom.text  # generic body, details in the log
    assert "radixserve_oom_batches_total 1.0" in metrics.splitlines()
    assert code == 0, out
    assert "OutOfMemoryError: CUDA out of memory" in out


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Threads:")))


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        return data, False
    except ConnectionResetError:
        pass
    return data, True


@pytest.mark.parametrize("stack", http_stacks())
def test_read_timeouts_keep_alive_and_tei_listeners(tiny_embedding_dir, tmp_path, stack):
    uds = str(tmp_path / "radixserve.sock")
    prom = free_port()
    srv = Proc(tiny_embedding_dir, "--header-read-timeout", "0.6", "--body-read-timeout", "0.6", "--http-stack", stack,
               "--uds-path", uds, "--prometheus-port", str(prom), "--cors-allow-origin", "https://app.example")
    try:
        # Slowloris: a header line every 0.2 s, never the blank line. Closed after ~0.6 s.
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            t0 = time.monotonic()
            s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\n")
            closed = False
            for i in range(20):
                time.sleep(0.2)
                try:
                    s.sendall(b"X-Slow-%d: y\r\n" % i)
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
            if not closed:
                _, closed = _read_until_closed(s, 0.5)
            assert closed and time.monotonic() - t0 < 3.0

        # A head that arrives in pieces within the limit, then keep-alive across two requests.
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
                s.sendall(part)
                time.sleep(0.15)
            s.settimeout(5)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(0.3)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")  # same connection, still open

        # A body that never completes: 408 in JSON, and the connection closes.
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"inputs\": ")
            data, closed = _read_until_closed(s, 3.0)
            assert data.startswith(b"HTTP/1.1 408") and b'"Timeout"' in data and closed, data

        with httpx.Client(transport=httpx.HTTPTransport(uds=uds), base_url="http://radixserve") as c:
            assert c.get("/health").status_code == 200
            assert len(c.post("/embed", json={"inputs": ["over the socket"]}).json()) == 1
        metrics = httpx.get(f"http://127.0.0.1:{prom}/metrics", timeout=5).text
        assert 'te_request_success{method="embed"} 1.0' in metrics  # the embed over the socket
        # The metrics listener answers /metrics only, and closes half-sent requests at the head
        # timeout, with no thread per connection.
        assert httpx.get(f"http://127.0.0.1:{prom}/embed", timeout=5).status_code == 404
        assert httpx.post(f"http://127.0.0.1:{prom}/metrics", timeout=5).status_code == 405
        threads = _threads(srv.proc.pid)
        half = [socket.create_connection(("127.0.0.1", prom)) for _ in range(40)]
        try:
            for s in half:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.3)
            assert _threads(srv.proc.pid) < threads + 5  # prometheus_client's server: one thread each
            t0 = time.monotonic()
            assert all(_read_until_closed(s, 5.0) == (b"", True) for s in half)
            assert time.monotonic() - t0 < 4.0
        finally:
            for s in half:
                s.close()
        pre = httpx.options(srv.url + "/embed", headers={"Origin": "https://app.example",
                                                          "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.get(srv.url + "/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        srv.proc.send_signal(signal.SIGTERM)
        code, out = srv.wait(timeout=600)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert code == 0, out
    assert not os.path.exists(uds)
    assert f"(HTTP stack: {stack})" in out


@pytest.mark.parametrize("stack", http_stacks())
def test_idle_connection_flood_neither_starves_health_nor_floods_the_log(tiny_embedding_dir, stack):
    # 2000 idle connections against a server allowed 256 open files (the attack held them open
    # with the default head timeout of 10 s; here 60 s, so only the connection cap can help).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2200:
        pytest.skip(f"the test process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2200), hard))
    srv = Proc(tiny_embedding_dir, "--http-stack", stack, "--header-read-timeout", "60", open_files=256)
    idle: list[socket.socket] = []
    try:
        for _ in range(2000):
            idle.append(socket.create_connection(("127.0.0.1", srv.port)))
        time.sleep(1.0)
        t0 = time.monotonic()
        health = httpx.get(srv.url + "/health", timeout=30)
        elapsed = time.monotonic() - t0
        embed = httpx.post(srv.url + "/embed", json={"inputs": "still serving"}, timeout=30)
    finally:
        for sock in idle:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        srv.proc.send_signal(signal.SIGTERM)
    code, out = srv.wait(timeout=600)
    # a starved probe would wait for the idle connections' 60 s head timeout, past its own 30 s
    assert health.status_code == 200, (elapsed, out[-2000:])
    assert embed.status_code == 200
    assert code == 0, out[-2000:]
    assert out.count("Too many open files") <= 3 and len(out.splitlines()) < 60, out[-4000:]
    assert "at the cap of 192 open connections" in out


def test_fault_injection_is_off_by_default_and_strict():
    runner = object()
    assert fault_server.inject_faults(runner, environ={}) is runner
    with pytest.raises(ValueError, match="unknown directive"):
        fault_server.inject_faults(runner, environ={fault_server.ENV: "explode=1"})

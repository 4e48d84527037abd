"""Running the image under test and the same checkpoint outside it: podman calls, a container
with its ports on loopback, and the reference server from this checkout
(tests/test_container_image.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = uuid.uuid4().hex[:8]  # names this run's containers and compose project
SAFETY_S = 900  # a bound no healthy step on a loaded 2-core machine comes near: only a safety net


def _podman(*args: str, check: bool = True, timeout: float = SAFETY_S) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} ... exit {proc.returncode}: {proc.stderr[-3000:]}")
    return proc


def _free_port() -> int:
    from tests.serving import free_port

    return free_port()


def _stop_timeout_from_docs() -> int:
    """The stop timeout the README's `docker run` line gives; docs/operations.md must agree."""
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("`docker run ") or "`docker run --gpus" in ln)
    found = re.search(r"--stop-timeout (\d+)", line)
    assert found, f"the README's docker run line gives no --stop-timeout: {line}"
    ops = (ROOT / "docs" / "operations.md").read_text()
    runs = [ln for ln in ops.splitlines() if ln.startswith("docker run ") and " -p " in ln]
    assert runs and all(f"--stop-timeout {found.group(1)}" in ln for ln in runs), runs
    return int(found.group(1))


class Container:
    """`podman run -d` of the image with a checkpoint at /models/m:ro, its ports on loopback."""

    def __init__(self, image: str, model_dir: Path, *, podman_args=(), server_args=(), name: str = "c") -> None:
        self.name = f"radixserve-test-{name}-{RUN_ID}"
        self.port, self.probe_port = _free_port(), _free_port()
        self.url, self.probe_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.probe_port}"
        _podman("rm", "-f", "-v", "--ignore", self.name, check=False)
        _podman("run", "-d", "--name", self.name, "--stop-timeout", str(_stop_timeout_from_docs()),
                "-p", f"127.0.0.1:{self.port}:8080", "-p", f"127.0.0.1:{self.probe_port}:9000",
                "-v", f"{model_dir}:/models/m:ro", *podman_args,
                image, "--model-id", "/models/m", "--prometheus-port", "9000", *server_args)

    def state(self) -> dict:
        return json.loads(_podman("inspect", self.name).stdout)[0]["State"]

    def logs(self) -> str:
        proc = _podman("logs", self.name, check=False)
        return proc.stdout + proc.stderr

    def wait_healthy(self) -> None:
        """Until /health answers 200; fails at once with the logs when the container exits."""
        _wait_healthy(self.url, lambda: None if self.state()["Running"]
                      else f"container exited during start:\n{self.logs()[-4000:]}",
                      lambda: self.logs()[-4000:])

    def remove(self) -> None:
        _podman("rm", "-f", "-v", "--ignore", self.name, check=False)


def _wait_healthy(url: str, exited, describe) -> None:
    """Until `url`/health answers 200; `exited()` returns why the server is gone (fail at once)."""
    deadline = time.monotonic() + SAFETY_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        gone = exited()
        if gone:
            raise AssertionError(gone)
        time.sleep(0.5)
    raise AssertionError(f"not healthy after {SAFETY_S} s (safety net):\n{describe()}")


class Outside:
    """`radixserve` from this checkout, outside any image, on the same checkpoint and flags."""

    def __init__(self, model_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k not in ("HOSTNAME", "PORT")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "--model-id", str(model_dir), "--hostname", "127.0.0.1",
             "--port", str(self.port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_healthy(self) -> None:
        _wait_healthy(self.url, lambda: None if self.proc.poll() is None else
                      f"reference server exited {self.proc.returncode}: {self.proc.stderr.read()[-3000:]}",
                      lambda: "reference server")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=SAFETY_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.proc.stderr:
            self.proc.stderr.close()

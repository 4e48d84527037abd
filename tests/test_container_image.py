"""The `cpu` image built from the repository's Dockerfile with podman, run as an operator runs it.

What an operator relies on, checked on the running container: /health (API port and the
`--prometheus-port` listener), /embed and /rerank answers equal (1e-5) to the same checkpoint
served by `radixserve` outside the image, the non-root user, the HEALTHCHECK in the image and
passing, a read-only root filesystem (docs/operations.md says it works), a SIGTERM drain that
exits 0 within the stop timeout the docs give, no build debris in /src, an unreadable mounted
checkpoint named at start as a permission problem, and the compose file's CPU service started for
real. The image size and the build time are reported on the terminal.

Without a Docker daemon or a registry, ../shared/tools/container-base.sh (beside the clone;
RADIXSERVE_CONTAINER_BASE names another path) installs podman and a local stand-in for
python:3.11-slim; its `--print-mounts` gives pip inside the build this machine's package index.
When it exits 3 (podman cannot run here) or is missing and no podman is installed, every test
here skips with the reason. RADIXSERVE_CONTAINER_SKIP (set by .ci/run) skips with its text.
RADIXSERVE_IMAGE_TORCH_INDEX_URL, when set (even empty), is passed as the TORCH_INDEX_URL build
argument. The build uses podman's layer cache (its storage survives between runs on a machine),
so an unchanged tree rebuilds in seconds and a source change reruns only the last install step.

Waits are on events (a health answer, the container's exit); the bounds are safety nets.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
yaml = pytest.importorskip("yaml")

from tests.containers import RUN_ID, SAFETY_S, Container, Outside, _podman  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "radixserve:cpu"  # the docs' tag; docker-compose.yml's CPU services use it
IMAGE_UID = 10001


def _report(config, line: str) -> None:
    """A line on the terminal whatever the capture mode (figures for the CI log)."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    if capture is None:  # pragma: no cover - pytest -p no:capture
        print(f"container image: {line}", file=sys.stderr, flush=True)
        return
    with capture.global_and_fixture_disabled():
        print(f"\ncontainer image: {line}", file=sys.stderr, flush=True)


def _uptime() -> str:
    try:
        return "load " + " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "load unknown"


# --- the engine and the image ------------------------------------------------------------------

def _build_mounts() -> list[str]:
    """Make podman able to build here; the pip set-up mounts for RUN steps. Skips with the reason."""
    reason = os.environ.get("RADIXSERVE_CONTAINER_SKIP")
    if reason:
        pytest.skip(reason)
    script = Path(os.environ.get("RADIXSERVE_CONTAINER_BASE") or ROOT.parent / "shared" / "tools" / "container-base.sh")
    if not script.is_file():
        if shutil.which("podman"):
            return []  # a machine with a registry: the base image is pulled
        pytest.skip(f"no podman, and no {script} to install it (RADIXSERVE_CONTAINER_BASE names its path)")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(f"{script.name} exit 3: {proc.stderr.strip()[-500:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    mounts = subprocess.run(["bash", str(script), "--print-mounts"], capture_output=True, text=True, check=True)
    return mounts.stdout.split()


@pytest.fixture(scope="module")
def image(request):
    """IMAGE built from the working tree (`--format docker`: the OCI format drops HEALTHCHECK)."""
    mounts = _build_mounts()
    build_args = []
    if "RADIXSERVE_IMAGE_TORCH_INDEX_URL" in os.environ:
        build_args = ["--build-arg", f"TORCH_INDEX_URL={os.environ['RADIXSERVE_IMAGE_TORCH_INDEX_URL']}"]
    cpu0, wall0 = os.times(), time.monotonic()
    proc = subprocess.run(
        ["podman", "build", "--format", "docker", "--layers", "--target", "cpu", "-t", IMAGE, *build_args, *mounts,
         str(ROOT)], capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - wall0
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    cached = proc.stdout.count("Using cache")
    size = int(_podman("image", "inspect", IMAGE, "--format", "{{.Size}}").stdout.strip())
    child = os.times().children_user + os.times().children_system - cpu0.children_user - cpu0.children_system
    _report(request.config, f"built {IMAGE} in {wall:.0f} s wall ({cached} steps from the layer cache, "
                            f"podman's own CPU {child:.0f} s), {_uptime()}")
    _report(request.config, f"{IMAGE} size {size / 1e6:.0f} MB ({size} bytes)")
    return IMAGE


@pytest.fixture(scope="module", autouse=True)
def _file_time(request):
    """The whole file's time on the terminal: the figure the README's CI budget quotes."""
    wall0 = time.monotonic()
    yield
    _report(request.config, f"tests/test_container_image.py took {time.monotonic() - wall0:.0f} s wall, {_uptime()}")


def _inspect_image(image: str) -> dict:
    return json.loads(_podman("image", "inspect", image).stdout)[0]


# --- checkpoints and containers ----------------------------------------------------------------

def _mountable(src, dst: Path, *, weights_mode: int = 0o644) -> Path:
    """A copy of checkpoint `src` that the image's user can read (or not: `weights_mode`)."""
    shutil.copytree(src, dst)
    for path in [dst, *dst.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (dst / "model.safetensors").chmod(weights_mode)
    return dst


@pytest.fixture(scope="module")
def served(image, request, tiny_embedding_dir, tiny_reranker_dir, tmp_path_factory):
    """The embedding and the reranker checkpoint, each in the image (read-only root filesystem, as
    docs/operations.md gives it) and outside it, started together and healthy."""
    root = tmp_path_factory.mktemp("container-models")
    emb = _mountable(tiny_embedding_dir, root / "embedding")
    rr = _mountable(tiny_reranker_dir, root / "reranker")
    # `--read-only` as Docker does it: podman alone would add tmpfs on /tmp, /var/tmp and /run.
    read_only = ("--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp")
    t0 = time.monotonic()
    started = {}
    try:
        started["emb"] = Container(image, emb, podman_args=read_only, name="emb")
        started["rr"] = Container(image, rr, podman_args=read_only, name="rr")
        started["emb-outside"] = Outside(emb)
        started["rr-outside"] = Outside(rr)
        for part in started.values():
            part.wait_healthy()
        _report(request.config, f"two containers and two reference servers healthy {time.monotonic() - t0:.0f} s "
                                f"after `podman run`, {_uptime()}")
        yield started
    finally:
        for part in started.values():
            part.remove() if isinstance(part, Container) else part.stop()


TEXTS = ["hello from the container", "the same checkpoint outside it", "hello from the container, longer"]


def _close(a, b, tol=1e-5) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    assert diff <= tol, diff
    return diff


def test_embed_answer_equals_the_checkpoint_served_outside(served, request):
    inside = httpx.post(served["emb"].url + "/embed", json={"inputs": TEXTS}, timeout=120)
    outside = httpx.post(served["emb-outside"].url + "/embed", json={"inputs": TEXTS}, timeout=120)
    assert inside.status_code == outside.status_code == 200, (inside.text, outside.text)
    assert len(inside.json()) == len(TEXTS)
    diff = _close(inside.json(), outside.json())
    _report(request.config, f"/embed in the image vs outside: max |difference| {diff:.2e}")


def test_rerank_answer_equals_the_checkpoint_served_outside(served, request):
    body = {"query": "which text is about containers?", "texts": TEXTS, "raw_scores": True}
    inside = httpx.post(served["rr"].url + "/rerank", json=body, timeout=120)
    outside = httpx.post(served["rr-outside"].url + "/rerank", json=body, timeout=120)
    assert inside.status_code == outside.status_code == 200, (inside.text, outside.text)
    by_index = [sorted(r.json(), key=lambda x: x["index"]) for r in (inside, outside)]
    assert [x["index"] for x in by_index[0]] == list(range(len(TEXTS)))
    diff = _close([x["score"] for x in by_index[0]], [x["score"] for x in by_index[1]])
    _report(request.config, f"/rerank in the image vs outside: max |difference| {diff:.2e}")


def test_prometheus_port_serves_health_and_metrics(served):
    c = served["emb"]
    assert httpx.get(c.probe_url + "/health", timeout=30).status_code == 200
    metrics = httpx.get(c.probe_url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "te_request_success" in metrics.text


def test_runs_as_the_unprivileged_user(served, image):
    assert _inspect_image(image)["Config"]["User"] == "radixserve"
    ids = _podman("exec", served["emb"].name, "id", "-u").stdout.strip()
    assert ids == str(IMAGE_UID)
    # the read-only root holds: the server process cannot write outside /data and /tmp
    probe = _podman("exec", served["emb"].name, "sh", "-c", "touch /home/radixserve/x", check=False)
    assert probe.returncode != 0 and "Read-only file system" in probe.stderr, probe
    assert _podman("exec", served["emb"].name, "sh", "-c", "touch /data/x && rm /data/x", check=False).returncode == 0


def test_healthcheck_is_in_the_image_and_passes(served, image):
    info = _inspect_image(image)
    check = info.get("Healthcheck") or info["Config"].get("Healthcheck") or {}  # podman's place, Docker's
    assert check.get("Test") and "/health" in " ".join(check["Test"]), check
    proc = _podman("healthcheck", "run", served["emb"].name, check=False)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)


def test_src_has_no_build_debris(image):
    listing = _podman("run", "--rm", "--entrypoint", "ls", image, "-A", "/src").stdout.split()
    assert "pyproject.toml" in listing and "server" in listing, listing
    assert "build" not in listing and not [n for n in listing if n.endswith(".egg-info")], listing


def test_sigterm_drains_and_exits_0_within_the_documented_stop_timeout(served):
    """`podman stop` sends SIGTERM and SIGKILLs after the container's stop timeout (the docs' value,
    given at `podman run`): exit status 0 (not 137) means the drain ended in time. Requests sent
    meanwhile get an answer or a JSON 503, never a 500."""
    c = served["emb"]
    assert c.state()["Running"]
    answers: list[int] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                try:
                    r = http.post(c.url + "/embed", json={"inputs": TEXTS})
                except httpx.HTTPError:
                    continue  # the listener is gone: nothing was accepted
                if r.status_code != 200:
                    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text
                answers.append(r.status_code)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    while not answers:  # a request in flight first
        time.sleep(0.05)
        assert thread.is_alive()
    _podman("stop", c.name)
    stop.set()
    thread.join(SAFETY_S)
    state = c.state()
    assert not state["Running"] and state["ExitCode"] == 0, (state, c.logs()[-3000:])
    logs = c.logs()
    assert "draining" in logs and "exiting with status 0" in logs, logs[-3000:]
    assert 200 in answers


def test_unreadable_mounted_checkpoint_is_named_as_a_permission_problem(image, tiny_embedding_dir, tmp_path):
    """save_pretrained's 0600 weights, root-owned, mounted into the uid-10001 container."""
    if os.getuid() != 0:
        pytest.skip("the case needs a checkpoint owned by another user than the image's (run as root)")
    bad = _mountable(tiny_embedding_dir, tmp_path / "m", weights_mode=0o600)
    proc = _podman("run", "--rm", "-v", f"{bad}:/models/m:ro", image, "--model-id", "/models/m", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    lines = [ln for ln in out.splitlines() if "PermissionError" in ln]
    assert len(lines) == 1, out[-3000:]
    assert f"cannot read /models/m/model.safetensors as uid {IMAGE_UID}" in lines[0], lines[0]
    assert f"chown -R {IMAGE_UID} /models/m" in lines[0], lines[0]
    assert "FileNotFoundError" not in out


# --- docker-compose.yml's CPU service, for real ------------------------------------------------

def test_compose_cpu_service_starts_from_the_built_image(image, tiny_embedding_dir, tmp_path, request):
    """`podman-compose --profile cpu up radixserve-cpu` with the image just built and the fixture
    checkpoint in the service's cache volume's place; Prometheus and Grafana need their images
    from a registry, so they are not started here (their files are checked in test_deploy_stack.py)."""
    if shutil.which("podman-compose") is None:
        pytest.skip("podman-compose not installed (pip install podman-compose)")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["radixserve-cpu"]
    host_port = int(service["ports"][0].split(":")[0])
    try:
        import socket

        with socket.create_server(("127.0.0.1", host_port)):
            pass
    except OSError:
        pytest.skip(f"host port {host_port} of the compose file is taken on this machine")
    model = _mountable(tiny_embedding_dir, tmp_path / "m")
    override = tmp_path / "override.yml"
    override.write_text(yaml.safe_dump({"services": {"radixserve-cpu": {
        "environment": {"MODEL_ID": "/models/m"}, "volumes": [f"{model}:/models/m:ro"]}}}))
    project = f"radixserve-test-{RUN_ID}"
    base = ["podman-compose", "-p", project, "-f", str(ROOT / "docker-compose.yml"), "-f", str(override),
            "--profile", "cpu"]
    try:
        up = subprocess.run([*base, "up", "-d", "--no-build", "radixserve-cpu"], capture_output=True, text=True,
                            timeout=SAFETY_S, cwd=ROOT)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        name = json.loads(_podman("ps", "--filter", f"label=io.podman.compose.project={project}",
                                  "--format", "json").stdout)[0]["Names"][0]
        url = f"http://127.0.0.1:{host_port}"
        deadline = time.monotonic() + SAFETY_S
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            state = json.loads(_podman("inspect", name).stdout)[0]["State"]
            assert state["Running"], _podman("logs", name, check=False).stderr[-3000:]
            assert time.monotonic() < deadline, "compose service not healthy (safety net)"
            time.sleep(0.5)
        r = httpx.post(url + "/embed", json={"inputs": TEXTS[:1]}, timeout=120)
        assert r.status_code == 200 and len(r.json()) == 1
        # stop_grace_period reaches `podman stop -t` (podman-compose applies it when stopping), and
        # the drain ends within it: exit 0, not SIGKILL's 137
        grace = compose["services"]["radixserve-cpu"]["stop_grace_period"]
        stop = subprocess.run([*base[:1], "--verbose", *base[1:], "stop", "radixserve-cpu"], capture_output=True,
                              text=True, timeout=SAFETY_S, cwd=ROOT)
        assert stop.returncode == 0 and f"podman stop -t {int(grace.rstrip('s'))} {name}" in stop.stderr, stop.stderr[-3000:]
        state = json.loads(_podman("inspect", name).stdout)[0]["State"]
        assert not state["Running"] and state["ExitCode"] == 0, state
    finally:
        subprocess.run([*base, "down", "-v"], capture_output=True, text=True, timeout=SAFETY_S, cwd=ROOT)

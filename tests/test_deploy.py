"""Shipping files: Dockerfile, docker-compose.yml, Prometheus, Grafana, Kubernetes manifests.

No Docker engine runs here, so these tests check what can be checked statically: every promised
property of the Dockerfile, the compose services/ports/volumes the docs name, that the dashboard
only queries series that scheduler.metrics.Metrics really exports, and that the CPU image
installs the same torch as CI. External validators (`docker compose config`, `promtool`) run
when they are installed and skip otherwise.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ARCHS = "8.0;8.6;8.9;9.0"


# --- Dockerfile --------------------------------------------------------------------------------

def dockerfile_stages(text: str) -> list[dict]:
    """Instructions per stage: [{name, base, instrs: [(KEYWORD, args)]}]; ARGs before FROM in stage -1."""
    lines, buf = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # comment lines inside a continuation are dropped by Docker too
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    stages = [{"name": None, "base": None, "instrs": []}]
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append({"name": name, "base": parts[0], "instrs": []})
        stages[-1]["instrs"].append((keyword, args.strip()))
    return stages


def env_of(stage: dict) -> dict[str, str]:
    out = {}
    for keyword, args in stage["instrs"]:
        if keyword == "ENV":
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                out[key] = value
    return out


def args_of(stage: dict) -> dict[str, str | None]:
    out = {}
    for keyword, args in stage["instrs"]:
        if keyword == "ARG":
            key, sep, value = args.partition("=")
            out[key] = value if sep else None
    return out


@pytest.fixture(scope="module")
def stages():
    parsed = dockerfile_stages((ROOT / "Dockerfile").read_text())
    return {s["name"]: s for s in parsed[1:]} | {"__global__": parsed[0], "__order__": parsed[1:]}


def test_dockerfile_stages_and_default_target(stages):
    order = [s["name"] for s in stages["__order__"]]
    assert set(order) == {"cuda-build", "cpu", "gpu"}
    assert order[-1] == "gpu", "the default target (last stage) must be the GPU image"
    assert stages["cuda-build"]["base"].startswith("nvidia/cuda:") and "-devel-" in stages["cuda-build"]["base"]
    assert stages["gpu"]["base"].startswith("nvidia/cuda:") and "-runtime-" in stages["gpu"]["base"]
    assert stages["cpu"]["base"] == "python:3.11-slim"
    # Devel and runtime bases come from the same CUDA/Ubuntu args, so the venv's python matches.
    assert stages["cuda-build"]["base"].replace("-devel-", "-runtime-") == stages["gpu"]["base"]


# NOTE: ids must not be "gpu": conftest skips every item carrying a "gpu" keyword without CUDA.
@pytest.mark.parametrize("target", ["gpu", "cpu"], ids=["gpu-target", "cpu-target"])
def test_final_images_promises(stages, target):
    stage = stages[target]
    instrs = stage["instrs"]
    users = [a for k, a in instrs if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entry = [a for k, a in instrs if k == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["radixserve"]
    assert not [a for k, a in instrs if k == "CMD"], "flags must pass straight through to radixserve"
    checks = [a for k, a in instrs if k == "HEALTHCHECK"]
    assert checks and "/health" in checks[-1] and "8080" in checks[-1]
    env = env_of(stage)
    assert env["HF_HOME"] == "/data"
    assert env["HOSTNAME"] == "0.0.0.0"
    volumes = [a for k, a in instrs if k == "VOLUME"]
    assert volumes and "/data" in volumes[-1]
    assert any(k == "EXPOSE" and a == "8080" for k, a in instrs)


def test_kernels_prebuilt_in_devel_and_copied(stages):
    build, gpu = stages["cuda-build"], stages["gpu"]
    assert env_of(build)["TORCH_CUDA_ARCH_LIST"] == ARCHS
    ext_dir = env_of(build)["TORCH_EXTENSIONS_DIR"]
    # Identical build flags at run time, else the extension loader wants to recompile.
    for key in ("TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR", "CUDA_HOME"):
        assert env_of(gpu)[key] == env_of(build)[key]
    runs = [a for k, a in build["instrs"] if k == "RUN"]
    assert any("kernels.build" in r for r in runs)
    copies = [a for k, a in gpu["instrs"] if k == "COPY"]
    assert any("--from=cuda-build" in c and c.split()[-1] == ext_dir for c in copies)
    assert any("--from=cuda-build" in c and c.split()[-1] == "/opt/venv" for c in copies)


def test_kernel_build_step_names_a_real_module(stages):
    """The devel stage's `python -m MODULE` build step must exist while kernels/ ships .cu files."""
    import importlib.util

    runs = [a for k, a in stages["cuda-build"]["instrs"] if k == "RUN" and "kernels." in a]
    modules = [m for r in runs for m in re.findall(r"python -m (kernels\.\w+)", r)]
    assert modules, "no kernel build step in the cuda-build stage"
    if not list((ROOT / "kernels").glob("*.cu")):
        pytest.skip("kernels/ ships no CUDA sources")
    for module in modules:
        assert importlib.util.find_spec(module) is not None, f"Dockerfile runs `python -m {module}`: missing"


def test_flash_attn_build_arg(stages):
    build = stages["cuda-build"]
    assert args_of(build)["WITH_FLASH_ATTN"] == "0"
    runs = [a for k, a in build["instrs"] if k == "RUN"]
    assert any("${WITH_FLASH_ATTN}" in r and "flash-attn" in r for r in runs)


def _torch_pin(text: str) -> str:
    pins = set(re.findall(r"\btorch==([0-9][\w.+]*)", text))
    assert len(pins) == 1, pins
    return pins.pop()


def test_cpu_image_installs_like_ci(stages):
    """Same torch pin as .ci/run, installed before the project, then the project itself."""
    ci = (ROOT / ".ci" / "run").read_text()
    ci_pin = _torch_pin(ci)
    assert stages["__global__"]["instrs"] and args_of(stages["__global__"])["TORCH_VERSION"] == ci_pin
    runs = [a for k, a in stages["cpu"]["instrs"] if k == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    project_step = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch_step < project_step
    assert "whl/cpu" in runs[torch_step]
    ci_steps = re.findall(r"pip install (.+)", ci)
    assert ci_steps[-2].startswith("torch==") and ci_steps[-1].startswith("-e ")


def test_dockerignore_keeps_what_the_build_copies():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]

    def ignored(path: str) -> bool:
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        for p in patterns:
            if p.startswith("**/") and any(fnmatch(part, p[3:]) for part in parts):
                return True
            if any(fnmatch(pre, p) for pre in prefixes):
                return True
        return False

    copied = []
    for keyword, args in (s for st in dockerfile_stages((ROOT / "Dockerfile").read_text()) for s in st["instrs"]):
        if keyword == "COPY" and "--from" not in args:
            copied += args.split()[:-1]
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), source
        assert not ignored(source), source
    for package in ("server", "scheduler", "models", "kernels", "loadtest"):
        for f in (ROOT / package).rglob("*"):
            if f.is_file() and f.suffix in (".py", ".cu", ".cpp"):
                assert not ignored(str(f.relative_to(ROOT))), f
    for heavy in (".git", "tests", "deploy/grafana", "x/__pycache__/a.pyc"):
        assert ignored(heavy), heavy


# --- docker compose ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_services_ports_volumes(compose):
    services = compose["services"]
    assert set(services) == {"radixserve", "radixserve-cpu", "prometheus", "grafana"}
    gpu, cpu = services["radixserve"], services["radixserve-cpu"]
    assert gpu["build"]["target"] == "gpu" and cpu["build"]["target"] == "cpu"
    assert "profiles" not in gpu and cpu["profiles"] == ["cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "deploy" not in cpu
    assert gpu["ports"] == ["8080:8080"] and cpu["ports"] == ["8081:8080"]
    assert services["prometheus"]["ports"] == ["9090:9090"] and services["grafana"]["ports"] == ["3000:3000"]
    for svc in (gpu, cpu):
        assert "hf-cache:/data" in svc["volumes"]
        assert svc["environment"]["HF_HOME"] == "/data"
    assert set(compose["volumes"]) == {"hf-cache", "prometheus-data", "grafana-data"}
    for svc in services.values():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source


def test_compose_env_names_are_server_flags(compose):
    """Every radixserve variable the compose file sets is a flag's env twin (or HF's own)."""
    from dataclasses import fields

    from server.config import ServerConfig, env_var

    flags = {env_var(f.name) for f in fields(ServerConfig)}
    env = compose["services"]["radixserve"]["environment"]
    assert set(env) - flags <= {"HF_HOME", "HF_TOKEN"}


def _docker_compose_cli() -> list[str] | None:
    """The Compose v2 plugin (v1 `docker-compose` predates the top-level `name:` key)."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_docker_compose_config_accepts_file():
    cli = _docker_compose_cli()
    if cli is None:
        pytest.skip("no docker compose CLI")
    proc = subprocess.run(
        [*cli, "-f", str(ROOT / "docker-compose.yml"), "--profile", "cpu", "config", "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


# --- Prometheus and Grafana --------------------------------------------------------------------

def test_prometheus_scrapes_radixserve():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "radixserve")
    assert job["metrics_path"] == "/metrics"
    targets = {t for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"radixserve:8080", "radixserve-cpu:8080"}


def test_promtool_check_config():
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed")
    proc = subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def exported_series() -> set[str]:
    """Sample names a scrape of scheduler.metrics.Metrics can contain (suffixes included)."""
    from scheduler.metrics import Metrics

    suffixes = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}
    return {fam.name + s for fam in Metrics().registry.collect() for s in suffixes[fam.type]}


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def metric_names(expr: str) -> set[str]:
    """Series names in a PromQL expression: identifiers that are not functions, keywords or labels."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end():].lstrip()
        if rest.startswith("(") or match.group() in _PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def test_metric_names_parser():
    expr = 'histogram_quantile(0.9, sum by (le) (rate(a_bucket{k="x"}[5m]))) / sum(b_total) - c'
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


@pytest.fixture(scope="module")
def dashboard():
    return json.loads((DEPLOY / "grafana" / "dashboards" / "radixserve.json").read_text())


def test_dashboard_queries_only_exported_metrics(dashboard):
    exported = exported_series()
    used = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, target["expr"]
            assert names <= exported, (panel["title"], names - exported)
            used |= names
    must = {
        "te_radix_mlp_compression_ratio_bucket", "te_radix_mlp_compression_ratio_sum",
        "te_radix_mlp_compression_ratio_count", "radixserve_tokens_total", "te_request_success_total",
        "te_request_duration_bucket", "te_queue_size", "radixserve_worker_idle_ratio",
    }
    assert must <= used, must - used


def test_dashboard_wiring(dashboard):
    datasources = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = datasources["datasources"][0]["uid"]
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid
        assert all(t["datasource"]["uid"] == uid for t in panel["targets"])
    providers = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "radixserve.yml").read_text())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/dashboards"] == providers["providers"][0]["options"]["path"]
    ratio_exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"] if "compression_ratio" in t["expr"]]
    assert any("histogram_quantile" in e for e in ratio_exprs)
    assert any("_sum" in e and "_count" in e and "/" in e for e in ratio_exprs)


# --- Kubernetes --------------------------------------------------------------------------------

def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()) if d]


def test_kubernetes_replicas():
    docs = {d["kind"]: d for d in _docs("radixserve.yaml")}
    assert set(docs) == {"Deployment", "Service"}
    assert docs["Service"]["spec"]["clusterIP"] == "None"
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert docs["Deployment"]["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_kubernetes_routers_hash_on_prefix_key():
    headless = _docs("radixserve.yaml")[1]["metadata"]["name"]
    envoy = {d["kind"]: d for d in _docs("router-envoy.yaml")}
    assert set(envoy) == {"ConfigMap", "Deployment", "Service"}
    config = yaml.safe_load(envoy["ConfigMap"]["data"]["envoy.yaml"])
    cluster = config["static_resources"]["clusters"][0]
    assert cluster["lb_policy"] in ("RING_HASH", "MAGLEV")
    assert cluster["common_lb_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] >= 100
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"]["address"].split(".")[0] == headless
    route = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    policy = route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["hash_policy"]
    assert policy == [{"header": {"header_name": "x-prefix-key"}}]
    nginx = {d["kind"]: d for d in _docs("router-nginx.yaml")}
    assert set(nginx) == {"ConfigMap", "Deployment", "Service"}
    conf = nginx["ConfigMap"]["data"]["default.conf"]
    assert re.search(r"hash \$prefix_key consistent;", conf)
    assert "$http_x_prefix_key" in conf and f"{headless}." in conf


def test_operations_doc_names_what_compose_ships(compose):
    doc = (ROOT / "docs" / "operations.md").read_text()
    for service in compose["services"]:
        assert service in doc, service
    for port in ("8080", "8081", "9090", "3000"):
        assert port in doc, port
    for path in ("deploy/kubernetes/router-envoy.yaml", "deploy/kubernetes/router-nginx.yaml", "X-Prefix-Key"):
        assert path in doc, path

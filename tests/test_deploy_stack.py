"""Shipping files, part 2: docker-compose, Prometheus, Grafana and the Kubernetes manifests.

Checks the compose services/ports/volumes the docs name, and that the dashboard only queries
series that scheduler.metrics.Metrics really exports. External validators (`docker compose
config`, `promtool`) run when they are installed and skip otherwise.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


# --- docker compose ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_services_ports_volumes(compose):
    services = compose["services"]
    assert set(services) == {"radixserve", "radixserve-cpu", "radixserve-replica", "router", "prometheus", "grafana"}
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
    replica, router = services["radixserve-replica"], services["router"]
    assert replica["profiles"] == ["router"] == router["profiles"] and replica["deploy"]["replicas"] == 2
    assert replica["environment"] == cpu["environment"] and replica["build"]["target"] == "cpu"
    assert router["ports"][0] == "8082:8080" and "./deploy/haproxy:/usr/local/etc/haproxy:ro" in router["volumes"]
    assert router["environment"]["RADIXSERVE_REPLICAS_DNS"] == "radixserve-replica"
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
        [*cli, "-f", str(ROOT / "docker-compose.yml"), "--profile", "cpu", "--profile", "router", "config", "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_podman_compose_config_accepts_every_profile():
    """podman-compose (PyPI) reads the file with each profile (Debian's docker-compose 1.29 cannot:
    it predates the top-level `name:`), and each profile brings exactly its services."""
    if shutil.which("podman-compose") is None or shutil.which("podman") is None:
        pytest.skip("podman-compose or podman not installed (pip install podman-compose)")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    always = {name for name, svc in compose["services"].items() if "profiles" not in svc}
    profiles = sorted({p for svc in compose["services"].values() for p in svc.get("profiles", [])})
    assert profiles == ["cpu", "router"], profiles
    for profile in [None, *profiles]:
        flags = ["--profile", profile] if profile else []
        proc = subprocess.run(["podman-compose", "-f", str(ROOT / "docker-compose.yml"), *flags, "config"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, (profile, proc.stderr[-3000:])
        resolved = yaml.safe_load(proc.stdout)
        expected = always | {n for n, svc in compose["services"].items() if profile in svc.get("profiles", [])}
        assert set(resolved["services"]) == expected, (profile, set(resolved["services"]))
        for name, svc in resolved["services"].items():
            for dep in svc.get("depends_on", {}):
                assert dep in resolved["services"], (profile, name, dep)  # podman-compose does not check it
            for volume in svc.get("volumes", []):
                source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
                if not source.startswith(("/", ".")):
                    assert source in compose["volumes"], (name, source)


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
        "te_radix_mlp_compression_ratio_count", "radixserve_tokens_total", "te_request_success",
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


def test_kubernetes_router_runs_the_checked_in_haproxy_config():
    """The router pod runs deploy/haproxy/haproxy.cfg (tests/test_router.py runs the same file)
    from a ConfigMap made of it, with its replicas from the headless Service's DNS name."""
    headless = _docs("radixserve.yaml")[1]["metadata"]["name"]
    router = {d["kind"]: d for d in _docs("router-haproxy.yaml")}
    assert set(router) == {"Deployment", "Service"}
    pod = router["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["RADIXSERVE_REPLICAS_DNS"].split(".")[0] == headless
    assert env["RADIXSERVE_REPLICAS_DNS"].endswith(".svc.cluster.local")  # HAProxy applies no search domains
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert container["args"][-1] == mount["mountPath"] + "/haproxy.cfg"
    assert next(v for v in pod["volumes"] if v["name"] == "config")["configMap"]["name"] == "radixserve-haproxy"
    text = (DEPLOY / "kubernetes" / "router-haproxy.yaml").read_text()
    assert "--from-file=deploy/haproxy/haproxy.cfg" in text and "configmap radixserve-haproxy" in text
    assert router["Service"]["spec"]["selector"] == router["Deployment"]["spec"]["selector"]["matchLabels"]


def test_operations_doc_names_what_compose_ships(compose):
    doc = (ROOT / "docs" / "operations.md").read_text()
    for service in compose["services"]:
        assert service in doc, service
    for port in ("8080", "8081", "8082", "9090", "3000"):
        assert port in doc, port
    for path in ("deploy/kubernetes/router-haproxy.yaml", "deploy/haproxy/haproxy.cfg", "deploy/haproxy/render.sh",
                 "X-Prefix-Key"):
        assert path in doc, path


def test_kubernetes_manifests_validate_against_the_api_schemas():
    """Every manifest document against the OpenAPI schemas of a current Kubernetes release (strict:
    a misspelt field fails), with the schemas kubernetes-validate bundles (no cluster, no network)."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    version = kv.latest_version()
    assert tuple(int(x) for x in version.split(".")[:2]) >= (1, 33), version
    checked = 0
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in _docs(path.name):
            kv.validate(doc, version, strict=True)
            checked += 1
    assert checked >= 4
    # the validator is not a no-op: a misspelt probe and a duration where seconds go both fail
    bad = _docs("radixserve.yaml")[0]
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, strict=True)
    bad = _docs("radixserve.yaml")[0]
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "35s"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, strict=True)


def test_image_and_manifests_agree_on_user_ports_probes_and_stop_grace(compose):
    """The Dockerfile's image and the Deployment (and compose) describe the same container."""
    from dataclasses import fields

    from server.config import ServerConfig
    from tests.test_deploy import dockerfile_stages, env_of

    stages = {s["name"]: s for s in dockerfile_stages((ROOT / "Dockerfile").read_text())[1:]}
    deployment = _docs("radixserve.yaml")[0]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    flag = {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}
    drain = next(f.default for f in fields(ServerConfig) if f.name == "graceful_shutdown_timeout")
    for target in ("gpu", "cpu"):
        instrs = stages[target]["instrs"]
        runs = " ".join(a for k, a in instrs if k == "RUN")
        user = [a for k, a in instrs if k == "USER"][-1]
        uid = int(re.search(rf"useradd .*--uid (\d+) {user}\b", runs).group(1))
        # user: the image's uid is the one the pod runs as, and its /data group
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == uid and pod["securityContext"]["fsGroup"] == uid
        # ports: the image's EXPOSE is the API port the pod names `http` and passes as --port
        exposed = [a for k, a in instrs if k == "EXPOSE"][-1]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert str(ports["http"]) == exposed == flag["--port"]
        assert {s.split(":")[-1] for svc in ("radixserve", "radixserve-cpu")
                for s in compose["services"][svc]["ports"]} == {exposed}
        # probes: the HEALTHCHECK's path, on the --prometheus-port listener the pod names `probes`
        check = [a for k, a in instrs if k == "HEALTHCHECK"][-1]
        path = re.search(r"127\.0\.0\.1:%s(/\w+)", check).group(1)
        assert str(ports["probes"]) == flag["--prometheus-port"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": path, "port": "probes"}, probe
        assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(ports["probes"])
        # the start allowance: the startup probe waits as long as the HEALTHCHECK's start period
        period = float(re.search(r"--start-period=(\d+)s", check).group(1))
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= period, (startup, period)
        # the cache volume: HF_HOME and the VOLUME are where the pod mounts its cache
        assert env_of(stages[target])["HF_HOME"] == "/data"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HOME"] == "/data" and {"name": "hf-cache", "mountPath": "/data"} in container["volumeMounts"]
    # stop grace: preStop + the drain + margin within Kubernetes' grace; compose and docker run
    # give the drain more than Docker's 10 s default
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
    for svc in ("radixserve", "radixserve-cpu", "radixserve-replica"):
        grace = compose["services"][svc]["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) > drain, (svc, grace)
    readme = (ROOT / "README.md").read_text()
    assert float(re.search(r"`docker run [^`]*--stop-timeout (\d+)", readme).group(1)) > drain

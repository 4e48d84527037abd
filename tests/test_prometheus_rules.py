"""The Prometheus side: deploy/prometheus's recording rules and alerts, and /metrics as promtool reads it.

`promtool check rules` and `promtool test rules` (the unit tests in radixserve-rules.test.yml make
each alert fire on synthetic series and stay silent on a neighbour) run when promtool is installed
(Debian's `prometheus` package; .ci/run installs it) and skip otherwise. A live server's /metrics
goes through `promtool check metrics`: the only lint findings allowed are the ones TEI's names force
on its three request counters.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.test_deploy_stack import exported_series, metric_names

yaml = pytest.importorskip("yaml")

PROM = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
RULES = PROM / "radixserve-rules.yml"
UNIT_TESTS = PROM / "radixserve-rules.test.yml"
TEI_COUNTERS = ("te_request_count", "te_request_success", "te_request_failure")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return path


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_check_rules():
    proc = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_rule_unit_tests_pass():
    proc = subprocess.run([_promtool(), "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True,
                          timeout=120, cwd=PROM)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    assert {"RadixserveDown", "RadixserveWorkerStalled", "RadixserveHigh5xxRate", "RadixserveQueueGrowing",
            "RadixserveCompressionCollapsed"} <= alerts
    fired, silent = set(), set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    assert fired == alerts, alerts ^ fired
    assert silent == alerts, alerts ^ silent


def test_rules_query_only_exported_series():
    """Every series a rule reads is one the server exports, `up`, or a series another rule records."""
    rules = _rules()
    recorded = {r["record"] for r in rules if "record" in r}
    known = exported_series() | recorded | {"up"}
    for rule in rules:
        names = metric_names(re.sub(r"\boffset\s+\w+", "", rule["expr"]))  # `offset 1d` names no series
        assert names, rule["expr"]
        assert names <= known, (rule.get("record") or rule.get("alert"), names - known)
    for name in recorded:
        assert re.fullmatch(r"radixserve:[a-z0-9_]+:[a-z0-9_]+", name), name  # level:metric:operations


def _exposition_types(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))


def test_exposition_types_tei_request_counters_as_counters_under_bare_names():
    from prometheus_client import generate_latest

    from scheduler.metrics import Metrics

    m = Metrics()
    m.request_count.labels(method="embed").inc(3)
    m.request_failure.labels(err="empty").inc()
    text = m.exposition().decode()
    types = _exposition_types(text)
    assert {name: types.get(name) for name in TEI_COUNTERS} == dict.fromkeys(TEI_COUNTERS, "counter")
    assert 'te_request_count{method="embed"} 3.0' in text and 'te_request_failure{err="empty"} 1.0' in text
    assert not any(name + "_total" in text or name + "_created" in text for name in TEI_COUNTERS)
    # everything else is exactly what prometheus_client renders
    plain = generate_latest(m.registry).decode()
    for name in TEI_COUNTERS:
        plain = plain.replace(f"# TYPE {name} gauge\n", f"# TYPE {name} counter\n")
    assert text == plain
    with pytest.raises(ValueError):  # a counter only goes up
        m.request_success.labels(method="embed").inc(-1)


def test_live_metrics_pass_promtool_check_metrics(tiny_embedding_dir):
    promtool = _promtool()
    from server.app import create_app
    from server.config import ServerConfig
    from tests.serving import ServerThread, cached_runner

    app = create_app(ServerConfig(model_id=str(tiny_embedding_dir)), runner=cached_runner(str(tiny_embedding_dir)))
    with ServerThread(app) as srv:
        assert httpx.post(srv.url + "/embed", json={"inputs": ["a shared start", "a shared end"]}).status_code == 200
        assert httpx.post(srv.url + "/embed", json={"inputs": []}).status_code in (400, 422)
        text = httpx.get(srv.url + "/metrics").text
    types = _exposition_types(text)
    assert {name: types.get(name) for name in TEI_COUNTERS} == dict.fromkeys(TEI_COUNTERS, "counter")
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    problems = {line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()}
    # TEI's names: counters without _total, and te_request_count's _count suffix (kept on purpose).
    forced = {f'{name} counter metrics should have "_total" suffix' for name in TEI_COUNTERS}
    forced.add('te_request_count non-histogram and non-summary metrics should not have "_count" suffix')
    assert problems == forced, problems ^ forced

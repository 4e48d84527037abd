"""The soak tool against a real tiny server for a couple of seconds, and its parts on their own."""
from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from loadtest import cli, soak
from server.app import create_app
from server.config import ServerConfig
from tests.serving import ServerThread, cached_runner


def test_soak_runs_a_bounded_mix_and_reports(tiny_embedding_dir, tmp_path):
    app = create_app(ServerConfig(model_id=str(tiny_embedding_dir), max_client_batch_size=8),
                     runner=cached_runner(str(tiny_embedding_dir)))
    with ServerThread(app) as srv:
        rc = cli.main(["soak", "--target", srv.url, "--duration", "2", "--concurrency", "7", "--interval", "0.5",
                       "--pid", str(os.getpid()), "--out", str(tmp_path)])
    data = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0 and data["ok"], data["problems"]
    st = data["statuses"]
    assert set(st) == set(soak.MIX)  # every kind of request was sent
    assert set(st["valid"]) <= {"200", "429"} and st["valid"].get("200", 0) > 0
    assert st["too_many_inputs"] == {"422": st["too_many_inputs"]["422"]}
    assert set(st["too_long"]) == {"422"} and set(st["malformed_json"]) == {"422"}
    assert set(st["oversized_body"]) <= {"413", "closed_early"}  # 413 before the body, then close
    assert set(st["disconnect_early"]) == set(st["disconnect_after_send"]) == {"closed"}
    samples = data["samples"]
    assert len(samples) >= 3 and all(s["health"] == 200 for s in samples)
    assert all(s["rss_bytes"] > 0 and s["open_fds"] > 0 for s in samples)  # this process serves
    assert samples[0]["drift"] == 0.0 and data["max_drift"] <= soak.DRIFT_TOL
    md = (tmp_path / "soak.md").read_text()
    assert "verdict: **ok**" in md and "| valid |" in md


def test_soak_refuses_non_loopback_targets():
    with pytest.raises(ValueError, match="this machine"):
        soak.check_loopback("http://10.0.0.1:8080")
    with pytest.raises(ValueError):
        soak.check_loopback("ftp://127.0.0.1:8080")
    assert soak.check_loopback("http://localhost:8080/") == "http://localhost:8080"


def test_soak_judges_drift_and_server_errors():
    result = soak.SoakResult(config={}, kind="embedding", statuses={"valid": {"200": 3, "500": 1}},
                             samples=[soak.Sample(0.0, None, None, 0.0, 1, 200),
                                      soak.Sample(1.0, None, None, 2e-5, 2, 200)])
    soak._judge(result)
    assert not result.ok and result.max_drift == 2e-5
    assert any("drift" in p for p in result.problems) and any("server errors" in p for p in result.problems)


def test_proc_and_metrics_stats():
    rss, fds = soak.proc_stats(os.getpid())
    assert rss > 0 and fds > 0
    assert soak.proc_stats(2**22 + 12345) == (None, None)  # beyond pid_max: no such process
    text = "# HELP x\nprocess_resident_memory_bytes 1.5e+08\nprocess_open_fds 42.0\nother 1\n"
    assert soak.metrics_stats(text) == (150_000_000, 42)
    assert soak.metrics_stats("te_queue_size 0\n") == (None, None)


def test_soak_stops_by_itself_at_max_requests(tiny_embedding_dir):
    app = create_app(ServerConfig(model_id=str(tiny_embedding_dir)), runner=cached_runner(str(tiny_embedding_dir)))
    with ServerThread(app) as srv:
        config = soak.SoakConfig(url=srv.url, duration_s=60, concurrency=2, interval_s=0.2, max_requests=10)
        t0 = time.monotonic()
        result = asyncio.run(soak.soak(config))
    assert time.monotonic() - t0 < 30  # the request cap ended it, not the 60 s duration
    assert sum(n for v in result.statuses.values() for n in v.values()) == 10
    assert result.samples and result.samples[-1].requests == 10

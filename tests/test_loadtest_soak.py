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


def test_rss_summary_start_peak_end_and_slopes():
    from loadtest.soak_rss import rss_markdown, rss_summary

    mib = 2 ** 20
    # 100 MiB growing 3 MiB a minute for 5 minutes, then flat at 115 MiB for 5 more; 50 requests a minute.
    rss = [100 + 3 * m for m in range(6)] + [115] * 5
    samples = [soak.Sample(60.0 * m, r * mib, 10, 0.0, 50 * m, 200) for m, r in enumerate(rss)]
    s = rss_summary(samples)
    assert (s["start_mib"], s["peak_mib"], s["end_mib"]) == (100.0, 115.0, 115.0)
    assert s["end_over_start"] == 1.15
    assert 0 < s["slope_mib_per_min"] < 3  # grew, then settled
    assert s["second_half_slope_mib_per_min"] == 0.0 and s["second_half_slope_mib_per_1k_requests"] == 0.0
    # over the rising part alone the slope is the 3 MiB a minute put in: 60 MiB per 1000 requests
    rising = rss_summary(samples[:6])
    assert rising["slope_mib_per_min"] == 3.0 and rising["slope_mib_per_1k_requests"] == 60.0
    line = rss_markdown(s)[0]
    assert "start 100.0 MiB" in line and "peak 115.0 MiB" in line and "second half +0.00 MiB/min" in line
    assert rss_summary([soak.Sample(0.0, None, None, None, 0, 200)]) is None
    assert "not sampled" in rss_markdown(None)[0]


def test_churn_inputs_differ_repeat_and_stay_bounded():
    info = {"max_input_length": 16384, "max_client_batch_size": 32}
    bodies = [soak._body("valid", "embedding", info, i, churn=True) for i in range(40)]
    texts = [tuple(json.loads(b)["inputs"]) for _, b, _ in bodies]
    assert len(set(texts)) == 40  # every request different
    assert soak._body("valid", "embedding", info, 7, churn=True) == bodies[7]  # seeded: a run repeats
    assert all(json.loads(b)["truncate"] is True for _, b, _ in bodies)
    words = [len(t.split()) for ts in texts for t in ts]
    assert max(words) <= soak._CHURN_MAX_WORDS and min(words) >= 1 and len(set(words)) > 10
    assert 1 <= min(len(t) for t in texts) and max(len(t) for t in texts) <= 4
    # hostile kinds are unchanged by churn; without churn the valid body is the fixed one
    assert soak._body("malformed_json", "embedding", info, 3, churn=True) == soak._body("malformed_json", "embedding", info, 3)
    assert json.loads(soak._body("valid", "embedding", info, 3)[1])["inputs"][0] == "soak input 3"
    route, body, _ = soak._body("valid", "reranker", info, 5, churn=True)
    assert route == "/rerank" and json.loads(body)["texts"]


def test_soak_with_churn_reports_rss_and_throughput(tiny_embedding_dir, tmp_path):
    app = create_app(ServerConfig(model_id=str(tiny_embedding_dir)), runner=cached_runner(str(tiny_embedding_dir)))
    with ServerThread(app) as srv:
        rc = cli.main(["soak", "--target", srv.url, "--duration", "1.5", "--concurrency", "2", "--interval", "0.3",
                       "--pid", str(os.getpid()), "--churn", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0 and data["ok"], data["problems"]
    assert data["config"]["churn"] is True and data["statuses"]["valid"].get("200", 0) > 0
    assert data["valid_per_s"] > 0
    rss = data["rss"]
    assert rss["start_mib"] <= rss["peak_mib"] and rss["end_mib"] <= rss["peak_mib"]
    # rounded to 0.1 MiB: within half of that (a peak of exactly x.x5 MiB rounds either way)
    assert abs(rss["peak_mib"] - max(s["rss_bytes"] for s in data["samples"]) / 2 ** 20) <= 0.05 + 1e-9
    md = (tmp_path / "soak.md").read_text()
    assert "churning inputs" in md and "RSS: start" in md and "Valid requests served" in md

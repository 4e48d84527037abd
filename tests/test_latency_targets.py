"""benchmarks/latency_targets.py and bench_latency's repeated runs: the one-input targets of
docs/performance/latency.md read off every run, with the count of runs that met each; an arm
from another checkout runs that checkout's code in every process it starts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import bench_latency, latency_targets

ROOT = Path(__file__).resolve().parents[1]


def _row(server, p50, p99, less_health=0.0):
    return {"server": server, "whole_p50_ms": p50, "whole_p99_ms": p99, "less_health_p50_ms": less_health}


def test_each_arm_gets_its_forwards_targets_counted_over_runs():
    runs = [[_row("zero", 1.0, 2.0, less_health=0.4), _row("real", 3.0, 4.0), _row("inf", 10.0, 12.0)],
            [_row("zero", 1.2, 2.0, less_health=0.6), _row("real", 3.3, 5.0), _row("inf", 10.0, 10.0)]]
    got = latency_targets.check(runs, {"zero": "zero", "real": "real"}, "inf")
    by = {(e["server"], e["target"].split()[0]): e for e in got}
    assert set(by) == {("zero", "whole"), ("real", "p50"), ("real", "p99")}  # the peer itself: none
    assert by["zero", "whole"]["values"] == [0.4, 0.6] and by["zero", "whole"]["met"] == 1
    assert by["real", "p50"]["values"] == [0.3, 0.33] and by["real", "p50"]["met"] == 1  # 0.3 is within
    assert by["real", "p99"]["values"] == [pytest.approx(4 / 12, abs=1e-4), 0.5] and by["real", "p99"]["met"] == 1
    text = latency_targets.table(got)
    assert "| real | p50 <= 0.3x inf's | 0.300x, 0.330x | 0.300x - 0.330x | 1 of 2 |" in text
    assert "| zero | whole less /health p50 <= 0.5 ms | 0.40 ms, 0.60 ms | 0.40 ms - 0.60 ms | 1 of 2 |" in text
    # without a peer only the zero-cost target applies
    assert [e["server"] for e in latency_targets.check(runs, {"zero": "zero", "real": "real"}, None)] == ["zero"]


@pytest.mark.slow
def test_repeated_runs_keep_the_servers_and_read_the_targets_off_each(tiny_embedding_dir, capsys):
    rc = bench_latency.main(["--model-dir", str(tiny_embedding_dir), "--arm", "zero=zero", "--arm", "real=real",
                             "--arm", "other=real", "--peer", "other", "--runs", "2", "--seed", "5",
                             "--requests", "6", "--warmup", "2", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["seed"] for r in doc["runs"]] == [5, 6]
    for run in doc["runs"]:  # each run is its own rounds, not the runs so far
        assert [r["n"] for r in run["rows"]] == [6, 6, 6]
    rows = [{r["server"]: r for r in run["rows"]} for run in doc["runs"]]
    by = {(e["server"], e["target"].split()[0]): e for e in doc["targets"]}
    assert set(by) == {("zero", "whole"), ("real", "p50"), ("real", "p99")}
    assert by["zero", "whole"]["values"] == [r["zero"]["less_health_p50_ms"] for r in rows]
    assert by["real", "p50"]["values"] == [round(r["real"]["whole_p50_ms"] / r["other"]["whole_p50_ms"], 4)
                                           for r in rows]
    assert doc["machine"]["load_end"]


@pytest.mark.slow
def test_an_arm_from_another_checkout_runs_its_front_ends_from_it_too(tiny_embedding_dir, tmp_path, capsys):
    # the other checkout: this one's packages, its front end marking which file it imported
    root = tmp_path / "checkout"
    for package in ("server", "scheduler", "models", "kernels", "fixtures", "loadtest", "benchmarks"):
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    marks = tmp_path / "imported"
    frontend = root / "server" / "frontends" / "frontend.py"
    future = "from __future__ import annotations\n"
    mark = f"open({str(marks)!r}, 'a').write(__file__ + '\\n')\n"
    frontend.write_text(frontend.read_text().replace(future, future + mark, 1))
    rc = bench_latency.main(["--model-dir", str(tiny_embedding_dir), "--arm", f"other=zero,root={root},api-servers=2",
                             "--requests", "2", "--warmup", "1", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["runs"][0]["rows"][0]["n"] == 2
    assert marks.read_text().splitlines() == [str(frontend)] * 2  # both front ends, from the other checkout

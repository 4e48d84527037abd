"""`compare --alternate`: concurrency-1 runs that take turns between targets request by request.

Two fake servers (tests.test_loadtest_run's, in threads; /metrics counts words + 1 per input as
tokens) write every request they answer into one shared arrival log, so the tests see the order
across targets; then the real radixserve, two servers up at once (prefix cache on and off) on
the tiny embedding fixture."""
from __future__ import annotations

import collections
import json
import threading

import pytest

from loadtest import alternate, cli, client, compare, datasets, report, workloads
from tests.test_loadtest_run import _fake_app


@pytest.fixture(scope="module")
def two_servers():
    import uvicorn

    arrivals: list = []
    servers, threads, urls = [], [], []
    for name in ("a", "b"):
        port = compare.free_port()
        srv = uvicorn.Server(uvicorn.Config(_fake_app(name, arrivals), host="127.0.0.1", port=port, log_level="error"))
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        servers.append(srv), threads.append(th), urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        client.wait_healthy(url, timeout=600)
    yield urls, arrivals
    for srv in servers:
        srv.should_exit = True
    for th in threads:
        th.join(timeout=10)


def _requests() -> list[workloads.Request]:
    return workloads.build_requests(datasets.synthetic(40, seed=3), "embed-query")


def test_no_target_always_follows_the_same_one():
    n = 7  # the latency targets' command: six arms and Infinity
    orders = [alternate.turn_order(i, n) for i in range(350)]
    assert all(sorted(order) == list(range(n)) for order in orders)  # every target once a round
    assert orders == [alternate.turn_order(i, n) for i in range(350)]  # a seed repeats a run
    assert orders != [alternate.turn_order(i, n, seed=1) for i in range(350)]
    turns = [k for order in orders for k in order]
    before: dict[int, collections.Counter] = {k: collections.Counter() for k in range(n)}
    for prev, k in zip(turns, turns[1:]):
        before[k][prev] += 1
    for k, counts in before.items():
        assert set(range(n)) - {k} <= set(counts), k  # every other target ran just before it
        assert max(counts.values()) < 0.3 * sum(counts.values()), (k, counts)  # none most of the time


def test_targets_take_turns_on_the_same_requests(two_servers):
    urls, arrivals = two_servers
    reqs = _requests()
    start, n, warmup = len(arrivals), 5, 1
    res_a, res_b = alternate.run(reqs, client.RunConfig(url="", concurrency=1, requests=n, warmup=warmup,
                                                        progress=False), urls)
    log = arrivals[start:]
    # the warm-up sends the list's first requests, marked; the measured rounds start from its head
    inputs = [tuple(workloads.marked(reqs[i]).body["inputs"]) for i in range(warmup)]
    inputs += [tuple(reqs[i].body["inputs"]) for i in range(n)]
    # Round i sends request i to both targets, in that round's order
    want = [("a", "b")[k] for i in range(warmup + n) for k in alternate.turn_order(i, 2)]
    assert [name for name, _ in log] == want
    assert [x for _, x in log] == [x for x in inputs for _ in range(2)]
    for res in (res_a, res_b):
        assert res.sent == res.ok == n and not res.errors and res.items_ok == n
        # a target's wall time is its own requests' time, and completions run on that clock
        assert res.wall_s == pytest.approx(sum(res.latencies_s))
        assert res.completions_s[-1] == pytest.approx(res.wall_s)
        # /metrics deltas cover exactly the measured requests (the warm-up round is excluded)
        assert res.metrics.tokens_original == sum(len(t.split()) + 1 for x in inputs[warmup:] for t in x)
    assert not set(inputs[:warmup]) & set(inputs[warmup:])  # no measured request was warmed up


def test_duration_bound_finishes_rounds_and_a_dead_target_only_fails_itself(two_servers):
    urls, _ = two_servers
    dead = f"http://127.0.0.1:{compare.free_port()}"
    cfg = client.RunConfig(url="", concurrency=1, duration=0.3, warmup=0, progress=False)
    live, gone = alternate.run(_requests(), cfg, [urls[0], dead])
    assert live.sent == gone.sent > 0  # a round once started is finished
    assert live.ok == live.sent and not live.errors
    assert gone.ok == 0 and dict(gone.errors) == {"connection": gone.sent}


def test_alternate_needs_concurrency_one(two_servers, tmp_path, capsys):
    urls, _ = two_servers
    with pytest.raises(ValueError, match="concurrency must be 1"):
        alternate.run(_requests(), client.RunConfig(url="", concurrency=2, requests=2, progress=False), urls)
    rc = cli.main(["compare", "--alternate", "--target", f"a={urls[0]}", "--target", f"b={urls[1]}",
                   "--workload", "embed-query", "--source", "synthetic", "--queries", "5", "--concurrency", "2"])
    assert rc == 2 and "--alternate sends one request at a time: pass --concurrency 1" in capsys.readouterr().err


def test_cli_alternate_report_says_so(two_servers, tmp_path):
    urls, _ = two_servers
    out = tmp_path / "out"
    rc = cli.main(["compare", "--alternate", "--target", f"a={urls[0]}", "--target", f"b={urls[1]}",
                   "--workload", "embed-query", "--source", "synthetic", "--queries", "5", "--concurrency", "1",
                   "--requests", "4", "--quiet", "--out", str(out)])
    assert rc == 0
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert [r["name"] for r in runs] == ["a", "b"] and all(r["alternate"] for r in runs)
    assert all(r["requests_ok"] == 4 for r in runs)
    assert "took turns request by request" in (out / "report.md").read_text()
    assert runs[0]["machine"] == runs[1]["machine"] and "- machine: " in (out / "report.md").read_text()


# ---------------------------------------------------------------- the real server


@pytest.mark.slow
def test_alternate_against_two_real_servers(tiny_embedding_dir, tmp_path):
    """Both servers are up during the run (started first, stopped after); they see the same
    queries, so their token counters agree, and only the one with the prefix cache reads from it:
    every request after the first shares the template. (Templated batches of many sequences: a lone
    short query may skip the cache where skipping measures cheaper, models/lone_choice.py.)"""
    targets = [compare.parse_server("off: --prefix-cache-size 0"), compare.parse_server("on: ")]
    reqs = workloads.build_requests(datasets.synthetic(80, seed=3), "embed-template")
    cfg = client.RunConfig(url="", concurrency=1, requests=6, warmup=1, progress=False)
    (t_off, off), (t_on, on) = compare.run_targets(targets, reqs, cfg, model_id=str(tiny_embedding_dir),
                                                   log_dir=tmp_path, startup_timeout=600, alternate=True)
    assert (t_off.name, t_on.name) == ("off", "on")
    for res in (off, on):
        assert res.ok == 6 and not res.errors, (res.errors, (tmp_path / "server-on.log").read_text()[-2000:])
    assert off.metrics.tokens_original == on.metrics.tokens_original > 0
    assert not off.metrics.cache_hit and on.metrics.cache_hit > 0
    s = report.summarize(on, name="on", meta={"alternate": True})
    assert s["requests_per_s"] == pytest.approx(6 / sum(on.latencies_s))

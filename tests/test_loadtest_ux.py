"""Load tester usability: ports for started servers (`NAME@PORT`, `NAME@LO-HI`, `--ports`), a dead
target caught before the run, the data source in every plot title, and the time-left line of
`--duration` runs (drawn only on a terminal)."""
from __future__ import annotations

import io
import json
import re
import shlex
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from loadtest import cli, client, compare, datasets, plot, workloads
from tests.test_loadtest_run import fake_server  # noqa: F401  (module-scoped live fake radixserve)

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- ports


def test_server_spec_ports():
    t = compare.parse_server("off@8001: --radix-mlp-threshold 0")
    assert (t.name, t.ports, t.flags, t.baseline) == ("off", (8001, 8001), ("--radix-mlp-threshold", "0"), False)
    b = compare.parse_server(" peer @ 8000-8010 :@baseline --batch-wait-ms 2")
    assert (b.name, b.ports, b.flags, b.baseline) == ("peer", (8000, 8010), ("--batch-wait-ms", "2"), True)
    assert compare.parse_server("plain: ").ports is None
    for bad in ("x@: ", "x@0: ", "x@9-8: ", "x@a: ", "x@70000: ", "x@1-2-3: ", "@80: "):
        with pytest.raises(ValueError):
            compare.parse_server(bad)
    assert cli.build_parser().parse_args(["compare", "--ports", "9000-9005"]).ports == (9000, 9005)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["compare", "--ports", "9005-9000"])


def test_pick_port_skips_ports_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"no free port on 127.0.0.1 in {port}-{port}"):
            compare.pick_port((port, port))
        # a range starting at the busy port moves on to a free one after it
        got = compare.pick_port((port, min(65535, port + 50)))
        assert port < got <= port + 50
    assert compare.pick_port((port, port)) == port  # free again once the listener is gone
    assert compare.pick_port(None) > 0


# A stdlib-only stand-in for radixserve (starts in a blink): GET /health, POST /rerank.
_FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
a = sys.argv[1:]
class H(BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.reply(200 if self.path == '/health' else 404, {})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
        self.reply(200, [{'index': i, 'score': 0.5} for i in range(len(body['texts']))])
    def log_message(self, *args):
        pass
ThreadingHTTPServer((a[a.index('--hostname') + 1], int(a[a.index('--port') + 1])), H).serve_forever()
"""


def test_compare_starts_a_server_on_its_port_range(tmp_path, capsys):
    """A started server gets the first free port of its NAME@LO-HI (the first one is taken here);
    its own range wins over --ports. The run succeeds and the server is gone afterwards."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        hi = min(65535, taken + 40)
        rc = cli.main([
            "compare", "--model-id", str(tmp_path), "--server-cmd", shlex.join([sys.executable, "-c", _FAKE_SERVER]),
            "--server", f"b@{taken}-{hi}: ", "--ports", str(taken),
            "--source", "synthetic", "--queries", "3", "--requests", "4", "--warmup", "0", "--concurrency", "2",
            "--startup-timeout", "60", "--quiet", "--out", str(tmp_path / "out"),
        ])
    err = capsys.readouterr().err
    assert rc == 0, err
    [port] = [int(p) for p in re.findall(r"--port (\d+)", err)]  # from compare's "[b] starting: ..." line
    assert taken < port <= hi
    [run] = json.loads((tmp_path / "out" / "report.json").read_text())["runs"]
    assert (run["name"], run["requests_ok"], run["error_count"]) == ("b", 4, 0)
    assert compare.pick_port((port, port)) == port  # stopped: the port is free again


def test_run_targets_port_choice(monkeypatch, tmp_path):
    """Own NAME@PORTS first, else the compare-wide range, else any free port."""
    used = []

    class Recorder:
        def __init__(self, argv, *, port, log_path, startup_timeout):
            used.append(port)
            self.url = f"http://127.0.0.1:{port}"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(compare, "ManagedServer", Recorder)
    monkeypatch.setattr(client, "run", lambda reqs, cfg: client.RunResult())
    own, shared = compare.free_port(), compare.free_port()
    targets = [compare.parse_server(f"a@{own}: "), compare.parse_server("b: "), compare.parse_server("c: ")]
    reqs = workloads.build_requests(datasets.synthetic(2), "rerank")
    cfg = client.RunConfig(url="http://127.0.0.1", progress=False)
    compare.run_targets(targets, reqs, cfg, model_id="m", log_dir=tmp_path, ports=(shared, shared))
    assert used == [own, shared, shared]  # one after another: they may share one port
    used.clear()
    compare.run_targets(targets[1:], reqs, cfg, model_id="m", log_dir=tmp_path)
    assert len(used) == 2 and all(p > 0 for p in used)


# ---------------------------------------------------------------- dead targets


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.server.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    srv.status = 200
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def test_probe(health_server):
    url = f"http://127.0.0.1:{health_server.server_address[1]}"
    for status in (200, 401, 404):
        health_server.status = status
        client.probe(url)
    health_server.status = 503
    with pytest.raises(client.TargetDown, match="not healthy: GET /health -> HTTP 503"):
        client.probe(url)
    with pytest.raises(client.TargetDown, match="nothing answers at http://127.0.0.1:"):
        client.probe(f"http://127.0.0.1:{compare.free_port()}")


def test_dead_target_stops_before_the_run(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(client, "run", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(compare, "run_targets", lambda *a, **k: ran.append(a))
    dead = f"http://127.0.0.1:{compare.free_port()}"
    common = ["--source", "synthetic", "--queries", "2", "--requests", "5000", "--quiet"]
    t0 = time.perf_counter()
    assert cli.main(["run", "--url", dead, *common]) == 2
    assert f"error: nothing answers at {dead}" in capsys.readouterr().err
    # compare checks running targets before it starts any server
    assert cli.main(["compare", "--target", f"x={dead}", "--server", "a: ", "--model-id", "/nowhere", *common]) == 2
    assert f"error: nothing answers at {dead}" in capsys.readouterr().err
    assert not ran and time.perf_counter() - t0 < 30


# ---------------------------------------------------------------- plot titles


@pytest.mark.parametrize("title,source,want", [
    ("My run", "synthetic(seed=0)", "My run — synthetic (seed 0)"),
    (None, "synthetic(seed=3,query_words=80-160)", "rerank — synthetic (seed 3, query_words 80-160)"),
    ("T", "msmarco-hf:v1.1/validation", "T — MS MARCO v1.1 (hub, validation)"),
    ("T", "file:d.jsonl", "T — file d.jsonl (MS MARCO schema)"),
    ("T on synthetic (seed 0)", "synthetic(seed=0)", "T on synthetic (seed 0)"),
    ("T", None, "T — source unknown"),
])
def test_figure_title_names_the_source(title, source, want):
    s = {"workload": "rerank", **({"source": source} if source else {})}
    assert plot.figure_title([s, dict(s)], title) == want


def test_cli_title_keeps_the_source(fake_server, tmp_path, monkeypatch):  # noqa: F811
    from matplotlib.figure import Figure

    titles = []
    original = Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda self, t, **kw: titles.append(t) or original(self, t, **kw))
    url, _ = fake_server
    assert cli.main(["run", "--url", url, "--source", "synthetic", "--queries", "2", "--seed", "4",
                     "--title", "Cache on", "--quiet", "--out", str(tmp_path)]) == 0
    assert titles == ["Cache on — synthetic (seed 4)"]
    assert (tmp_path / "report.md").read_text().startswith("# Cache on\n")


# ---------------------------------------------------------------- time left


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_duration_run_shows_time_left(fake_server, monkeypatch):  # noqa: F811
    url, _ = fake_server
    reqs = workloads.build_requests(datasets.synthetic(3, seed=1), "embed-query")
    monkeypatch.setattr(client, "PROGRESS_INTERVAL_S", 0.1)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    res = client.run(reqs, client.RunConfig(url=url, concurrency=2, duration=0.6, warmup=0))
    lines = [x.strip() for x in term.getvalue().split("\r") if x.strip()]
    assert len(lines) >= 4, lines  # redrawn while running, not only at the end
    # M:SS elapsed (rounded down) / duration and time left (rounded up); exact values vary with load
    assert re.fullmatch(r"0:00 / 0:01, 0:01 left, 0 requests, 0 errors", lines[0]) and term.getvalue().endswith("\n")
    assert re.fullmatch(rf"0:0\d / 0:01, 0:00 left, {res.sent} requests, 0 errors", lines[-1]), lines[-1]
    done = [int(x.split(", ")[2].split()[0]) for x in lines]
    assert done == sorted(done) and res.ok == res.sent > 0

    # quiet, and not a terminal: nothing at all
    for stream, progress in ((_Terminal(), False), (io.StringIO(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        client.run(reqs, client.RunConfig(url=url, concurrency=1, duration=0.3, warmup=0, progress=progress))
        assert stream.getvalue() == ""

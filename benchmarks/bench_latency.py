"""Where one short request's time goes: per-stage latency of a one-input embedding request.

    python -m benchmarks.bench_latency [--preset tiny-embedding | --model-dir DIR] [--requests 600]
        [--arm zero=zero] [--arm real=real] [--arm real-cache-off=real,cache=0]
        [--arm before=zero,root=/path/to/other/checkout] [--target infinity=URL --model NAME]
        [--runs N] [--seed S] [--peer NAME] [--route embed|openai] [--log-dir DIR] [--json]

Each ``--arm NAME=FORWARD[,cache=SIZE][,root=DIR][,api-servers=N]`` is the real CLI
(``server.cli.main``) in a subprocess on the preset's fixture: FORWARD ``zero`` replaces the
runner's forward by one that returns zeros of the right shape (``benchmarks.host_child.zero_forward``:
everything else, prefix cache and trie included, is real), ``real`` keeps it. ``root``: import the
server from that checkout instead (a before/after comparison; stages are stamped only where that
checkout has ``scheduler/stages.py``). ``--target NAME=URL`` adds a server already running (a peer
such as Infinity: totals only). One keep-alive connection per server on a raw socket; in each round
every server answers ``GET /health`` then one embedding request, the servers taking turns in an
order shuffled afresh each round (``loadtest.alternate.turn_order``, ``--seed``), so the machine's
load, and what ran just before, fall on all of them alike.

Stage stamps come from ``scheduler/stages.py`` (a recorder the child installs; off in the
product): loop (client send -> front door), tokenization, admit (queued), batch formed, prep
(``runner.prepare``), forward (``runner.run``), settle (the loop resolved the request), response
written, client read. Per server: p50 and p99 of each stage and of the whole, /health's p50 on the
same connection, and the whole less /health (the median of the per-round differences). A stage's
p50s need not add up to the whole's p50 (medians do not add); each request's stages do
(``stages.durations``). ``--runs N`` repeats the rounds N times (seeds S..S+N-1) with the servers
up throughout, and the latency targets are read off every run against ``--peer``
(``benchmarks/latency_targets.py``): each run's value and in how many runs each was met.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from benchmarks import latency_targets
from benchmarks.bench_front import ONE_INPUT, ONE_INPUT_ROUTES, _quantile
from loadtest import machine
from loadtest.alternate import turn_order

PREFIX = "BENCHLATENCY "  # the child's answers on stdout carry it (logs go to stderr)
STEPS = ("loop", "tokenization", "admit", "batch formed", "prep", "forward", "settle", "response written",
         "client read")


# ---- the server side (the child process) -------------------------------------------------------

def serve_child(argv: list[str]) -> int:
    """``[FORWARD, ROOT, *cli args]``: the CLI with the stage recorder (and the zero forward for
    FORWARD "zero"); answers each "stamps" line on stdin with one JSON line of what was stamped."""
    forward, root, *cli_argv = argv
    if root:
        sys.path.insert(0, root)
        # NOTE: the front ends the engine starts (``python -m server.frontends.frontend``) import
        # from their working directory first: the checkout's, so they are ``root``'s too
        os.chdir(root)
    from benchmarks.host_child import zero_forward

    import server.app
    from server import cli

    log = None
    try:
        from scheduler import stages
    except ImportError:  # a checkout without the stage stamps: totals only
        stages = None
    if stages is not None:
        log = stages.StampLog()
        stages.recorder = log
    if forward == "zero":
        real_load = server.app.load_runner

        def load_runner(config):
            runner = real_load(config)
            zero_forward(runner, {})
            return runner

        server.app.load_runner = load_runner  # cli.main imports it from server.app at call time

    def answer() -> None:
        for line in sys.stdin:
            if line.strip() == "stamps":
                print(PREFIX + json.dumps(log.take() if log is not None else {}), flush=True)

    threading.Thread(target=answer, name="bench-latency-stamps", daemon=True).start()
    return cli.main(cli_argv)


# ---- the client side (this process) ------------------------------------------------------------

@dataclass
class Arm:
    name: str
    forward: str = "real"  # "zero" or "real"
    cache: str | None = None  # --prefix-cache-size (None: the server's default)
    root: str = ""
    api_servers: int = 1
    url: str = ""
    proc: subprocess.Popen | None = None
    got: dict = field(default_factory=lambda: {"whole": [], "health": [], "sent": {}})

    @classmethod
    def parse(cls, spec: str) -> "Arm":
        name, _, rest = spec.partition("=")
        forward, *opts = rest.split(",")
        arm = cls(name, forward or "real")
        if arm.forward not in ("zero", "real"):
            raise SystemExit(f"--arm {spec}: the forward is 'zero' or 'real'")
        for opt in opts:
            key, _, value = opt.partition("=")
            if key == "cache":
                arm.cache = value
            elif key == "root":
                arm.root = os.path.abspath(value)
            elif key == "api-servers":
                arm.api_servers = int(value)
            else:
                raise SystemExit(f"--arm {spec}: unknown option {key!r}")
        return arm

    def start(self, model: str, port: int, extra: list[str], log_dir: str | None = None) -> None:
        argv = ["--model-id", model, "--hostname", "127.0.0.1", "--port", str(port), *extra]
        if self.cache is not None:
            argv += ["--prefix-cache-size", self.cache]
        if self.api_servers > 1:
            argv += ["--api-server-count", str(self.api_servers)]
        self.url = f"http://127.0.0.1:{port}"
        # NOTE: benchmarks/ comes from this checkout; the child puts ``root`` first for the rest.
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_latency", "--serve-child", self.forward, self.root, *argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            stderr=open(os.path.join(log_dir, f"{self.name}.log"), "w") if log_dir else subprocess.DEVNULL)

    def wait(self) -> None:
        from loadtest.client import wait_healthy

        proc = self.proc
        wait_healthy(self.url, timeout=600.0, alive=(lambda: proc.poll() is None) if proc is not None else None)

    def stamps(self) -> dict:
        if self.proc is None:
            return {}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stamps\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
        raise RuntimeError(f"{self.name} exited (status {self.proc.wait()})")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def exchange(sock: socket.socket, method: str, path: str, body: bytes = b"", rid: str = "") -> tuple[float, float]:
    """One keep-alive HTTP/1.1 exchange on a raw socket: (perf_counter at send, at the last byte)."""
    extra = f"x-request-id: {rid}\r\n" if rid else ""
    head = (f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    t0 = time.perf_counter()
    sock.sendall(head + body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"{path}: the server closed the connection")
        buf += chunk
    raw, _, rest = buf.partition(b"\r\n\r\n")
    status = raw.split(b"\r\n", 1)[0]
    if b" 200 " not in status + b" ":
        raise RuntimeError(f"{path}: {status.decode(errors='replace')}")
    length = 0
    for line in raw.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(rest) < length:
        rest += sock.recv(65536)
    return t0, time.perf_counter()


def run(arms: list[Arm], *, requests: int, route: str, model: str | None, warmup: int = 50,
        seed: int = 0) -> list[dict]:
    """The rounds (``warmup`` unrecorded first), then one row per server."""
    path = ONE_INPUT_ROUTES[route]
    payload: dict = {"inputs": ONE_INPUT} if route == "embed" else {"input": ONE_INPUT}
    if model is not None and route == "openai":
        payload["model"] = model
    body = json.dumps(payload).encode()
    socks = {}
    for arm in arms:
        arm.got = {"whole": [], "health": [], "sent": {}}  # this run's only
        u = urlsplit(arm.url)
        socks[arm.name] = s = socket.create_connection((u.hostname, u.port or 80))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(warmup + requests):
        for arm in (arms[k] for k in turn_order(i, len(arms), seed)):
            s = socks[arm.name]
            h0, h1 = exchange(s, "GET", "/health")
            rid = f"lat{i}"
            t0, t1 = exchange(s, "POST", path, body, rid)
            if i >= warmup:
                arm.got["health"].append((h1 - h0) * 1e3)
                arm.got["whole"].append((t1 - t0) * 1e3)
                arm.got["sent"][rid] = (t0, t1)
    for s in socks.values():
        s.close()
    return [summary(arm, arm.stamps()) for arm in arms]


def summary(arm: Arm, stamps: dict) -> dict:
    from scheduler.stages import durations

    whole, health = arm.got["whole"], arm.got["health"]
    row: dict = {"server": arm.name, "n": len(whole),
                 "whole_p50_ms": round(statistics.median(whole), 3), "whole_p99_ms": round(_quantile(whole, 0.99), 3),
                 "health_p50_ms": round(statistics.median(health), 3),
                 "less_health_p50_ms": round(statistics.median(w - h for w, h in zip(whole, health)), 3)}
    steps: dict[str, list[float]] = {s: [] for s in STEPS}
    for rid, (sent, done) in arm.got["sent"].items():
        d = durations(stamps.get(rid, {}), sent, done)
        if d is not None:
            for k, v in d.items():
                steps[k].append(v * 1e3)
    if steps["loop"]:
        row["staged"] = len(steps["loop"])
        row["stages"] = {k: {"p50_ms": round(statistics.median(v), 3), "p99_ms": round(_quantile(v, 0.99), 3)}
                         for k, v in steps.items()}
    return row


def table(rows: list[dict]) -> str:
    """Markdown: one column per server, a row per stage (p50 / p99 ms)."""
    head = "| stage, ms p50 / p99 | " + " | ".join(r["server"] for r in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]
    for step in STEPS:
        cells = [f"{r['stages'][step]['p50_ms']:.3f} / {r['stages'][step]['p99_ms']:.3f}" if "stages" in r else "-"
                 for r in rows]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines.append("| **whole** | " + " | ".join(f"**{r['whole_p50_ms']:.3f} / {r['whole_p99_ms']:.3f}**"
                                              for r in rows) + " |")
    lines.append("| /health, same connection (p50) | " + " | ".join(f"{r['health_p50_ms']:.3f}" for r in rows) + " |")
    lines.append("| whole less /health (p50 of pairs) | " + " | ".join(f"{r['less_health_p50_ms']:.3f}"
                                                                       for r in rows) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-child"]:
        return serve_child(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_latency", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-embedding")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=FORWARD[,cache=S][,root=DIR][,api-servers=N]")
    ap.add_argument("--target", action="append", default=[], metavar="NAME=URL", help="a running peer")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--route", choices=sorted(ONE_INPUT_ROUTES), default="embed")
    ap.add_argument("--model", default=None, help="the body's model name (openai route)")
    ap.add_argument("--served-model-name", default=None, help="passed to every arm's server")
    ap.add_argument("--log-dir", default=None, help="the servers' logs go to DIR/NAME.log (default: dropped)")
    ap.add_argument("--seed", type=int, default=0, help="the rounds' shuffled orders (run k: seed + k)")
    ap.add_argument("--runs", type=int, default=1, help="runs of --requests rounds, the servers up throughout")
    ap.add_argument("--peer", default=None,
                    help="the server the latency targets' ratios divide by (default: the first --target)")
    ap.add_argument("--model-dir", default=None, help="a checkpoint directory (default: the --preset fixture)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import fixtures
    from benchmarks.host_ceiling import free_port

    arms = [Arm.parse(s) for s in (a.arm or ["zero=zero", "real=real"])]
    forwards = {arm.name: arm.forward for arm in arms}
    for spec in a.target:
        name, _, url = spec.partition("=")
        arms.append(Arm(name, url=url))
    peer = a.peer or (a.target[0].partition("=")[0] if a.target else None)
    if peer is not None and peer not in {arm.name for arm in arms}:
        raise SystemExit(f"--peer {peer}: no --arm or --target of that name")
    model = os.path.abspath(a.model_dir) if a.model_dir else str(fixtures.cached(a.preset))  # the child may chdir
    extra = ["--served-model-name", a.served_model_name] if a.served_model_name else []
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
    host = machine.current()
    try:
        for arm in arms:
            if not arm.url:
                arm.start(model, free_port(), extra, a.log_dir)
        for arm in arms:
            arm.wait()
        runs = [run(arms, requests=a.requests, route=a.route, model=a.model, warmup=a.warmup, seed=a.seed + k)
                for k in range(a.runs)]
    finally:
        for arm in arms:
            arm.stop()
    load, host = os.getloadavg(), machine.finish(host)
    targets = latency_targets.check(runs, forwards, peer)
    if a.json:
        print(json.dumps({"load": load, "machine": host, "targets": targets,
                          "runs": [{"seed": a.seed + k, "rows": rows} for k, rows in enumerate(runs)]}, indent=1))
        return 0
    print(f"{machine.line(host)}; {a.runs} run(s) of {a.requests} rounds")
    for k, rows in enumerate(runs):
        print(f"\nrun {k + 1} (seed {a.seed + k}):\n\n{table(rows)}")
    if targets:
        print(f"\nthe latency targets (docs/performance/latency.md):\n\n{latency_targets.table(targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

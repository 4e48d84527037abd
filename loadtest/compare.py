"""Run one workload against several targets in turn and put them side by side.

A target is a URL (`NAME=http://127.0.0.1:8080`) or a server this module starts itself:
`NAME: FLAGS` starts `radixserve --model-id DIR --hostname 127.0.0.1 --port P FLAGS`, and
`NAME:@baseline [FLAGS]` starts the transformers peer (`python -m loadtest.baseline`). Started
servers get a free loopback port (any, or the first free one of `NAME@PORT` / `NAME@LO-HI`, for
hosts where only some ports may be opened), must answer GET /health before the run, and are
stopped (and only they) right after their own run, so targets never compete for the CPU/GPU.
With `alternate` (concurrency 1 only) every server is started first and the targets take turns
request by request (loadtest.alternate); they are all stopped at the end.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest import alternate as alternate_runs
from loadtest import client
from loadtest.workloads import Request

BASELINE = "@baseline"


@dataclass(frozen=True)
class Target:
    name: str
    url: str | None = None  # set for a running server
    flags: tuple[str, ...] = ()  # for a server we start
    baseline: bool = False
    ports: tuple[int, int] | None = None  # inclusive range to pick a started server's port from
    metrics_urls: tuple[str, ...] = ()  # a router's replicas: /metrics read from each and added

    @property
    def managed(self) -> bool:
        return self.url is None


def parse_target(spec: str) -> Target:
    """`NAME=URL` (running server), or `NAME=ROUTER_URL@REPLICA_URL,REPLICA_URL,...`: requests go
    to the router and the server-side figures add up the replicas' own /metrics (through a router,
    GET /metrics would reach one replica only)."""
    name, sep, url = spec.partition("=")
    url, _, replicas = url.partition("@http")
    if not sep or not name.strip() or not url.strip():
        raise ValueError(f"--target wants NAME=URL or NAME=URL@URL,URL,..., got {spec!r}")
    metrics = tuple(client.check_url(u.strip()) for u in ("http" + replicas).split(",")) if replicas else ()
    return Target(name=name.strip(), url=client.check_url(url.strip()), metrics_urls=metrics)


def parse_ports(text: str) -> tuple[int, int]:
    """`PORT` or `LO-HI` (inclusive, 1 <= LO <= HI <= 65535) -> (LO, HI)."""
    lo, _, hi = text.strip().partition("-")
    try:
        r = (int(lo), int(hi or lo))
    except ValueError:
        r = (0, 0)
    if not 1 <= r[0] <= r[1] <= 65535:
        raise ValueError(f"ports must be PORT or LO-HI with 1 <= LO <= HI <= 65535, got {text!r}")
    return r


def parse_server(spec: str) -> Target:
    """`NAME[@PORTS]: FLAGS` (radixserve with FLAGS) or `NAME[@PORTS]:@baseline [FLAGS]` (the peer
    baseline); PORTS is `PORT` or `LO-HI` (see `parse_ports`)."""
    head, sep, rest = spec.partition(":")
    name, at, port_spec = head.partition("@")
    if not sep or not name.strip():
        raise ValueError(f"--server wants 'NAME[@PORT|@LO-HI]: FLAGS' or 'NAME:@baseline', got {spec!r}")
    ports = parse_ports(port_spec) if at else None
    flags = shlex.split(rest)
    baseline = bool(flags) and flags[0] == BASELINE
    if baseline:
        flags = flags[1:]
    for f in flags:
        if f in ("--port", "--model-id", "--hostname") or f.startswith(("--port=", "--model-id=", "--hostname=")):
            raise ValueError(f"--server flags must not set {f.split('=')[0]}: compare chooses it")
    return Target(name=name.strip(), flags=tuple(flags), baseline=baseline, ports=ports)


def log_name(name: str) -> str:
    """`server-NAME.log` with NAME reduced to [A-Za-z0-9._-] (never a path outside the log dir)."""
    return "server-" + re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") + ".log"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_bind(port: int) -> bool:
    # SO_REUSEADDR as uvicorn sets it: a port whose last server left TIME_WAIT connections is
    # usable again, one that something listens on is not.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pick_port(ports: tuple[int, int] | None) -> int:
    """Any free loopback port (None), else the first free one of the inclusive range; RuntimeError
    when none is. Targets run one after another, so they may share a range, even a single port."""
    if ports is None:
        return free_port()
    lo, hi = ports
    for port in range(lo, hi + 1):  # bounded: at most 65535 bind attempts
        if _can_bind(port):
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {lo}-{hi}")


def server_command(target: Target, *, model_id: str, port: int, server_cmd: str | None = None) -> list[str]:
    """The argv that starts `target` on 127.0.0.1:port."""
    if target.baseline:
        base = [sys.executable, "-m", "loadtest.baseline"]
    elif server_cmd:
        base = shlex.split(server_cmd)
    else:
        exe = shutil.which("radixserve")
        base = [exe] if exe else [sys.executable, "-m", "server.cli"]
    return [*base, "--model-id", model_id, "--hostname", "127.0.0.1", "--port", str(port), *target.flags]


class ManagedServer:
    """A server subprocess for one target; a context manager that always stops it."""

    def __init__(self, argv: list[str], *, port: int, log_path: Path, startup_timeout: float) -> None:
        self.argv, self.port, self.log_path, self.startup_timeout = argv, port, log_path, startup_timeout
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "ManagedServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy())
            client.wait_healthy(self.url, timeout=self.startup_timeout, alive=lambda: self.proc.poll() is None)
        except Exception as e:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"server did not start: {shlex.join(self.argv)}\n--- log tail ---\n{tail}") from e
        except BaseException:  # Ctrl-C, SystemExit (SIGTERM): stop the server, keep the exception
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM, up to 20 s for a graceful exit, then SIGKILL (also if the wait is interrupted)."""
        proc = self.proc
        try:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            if getattr(self, "_log", None) is not None:
                self._log.close()
                self._log = None

    def __exit__(self, *exc) -> None:
        self.stop()


def _url(t: Target, stack: contextlib.ExitStack, *, model_id, server_cmd, log_dir: Path, startup_timeout: float,
         ports) -> str:
    """The URL to load: a running target's own, or that of a server started for `t` and stopped
    when `stack` closes."""
    if not t.managed:
        print(f"[{t.name}] {t.url}", file=sys.stderr)
        return t.url
    port = pick_port(t.ports or ports)
    argv = server_command(t, model_id=model_id, port=port, server_cmd=server_cmd)
    print(f"[{t.name}] starting: {shlex.join(argv)}", file=sys.stderr)
    srv = ManagedServer(argv, port=port, log_path=log_dir / log_name(t.name), startup_timeout=startup_timeout)
    return stack.enter_context(srv).url


def run_targets(
    targets: list[Target],
    requests: list[Request],
    cfg: client.RunConfig,
    *,
    model_id: str | None = None,
    server_cmd: str | None = None,
    log_dir: Path = Path("."),
    startup_timeout: float = 300.0,
    on_result=None,
    ports: tuple[int, int] | None = None,
    alternate: bool = False,
) -> list[tuple[Target, client.RunResult]]:
    """Run `requests` against each target in turn with the same client settings. `ports` is the
    range for started servers that name none of their own (None: any free port). `alternate`:
    start every server first, then take turns request by request (loadtest.alternate;
    concurrency 1 only)."""
    if not targets:
        raise ValueError("compare needs at least one target")
    if any(t.managed for t in targets) and not model_id:
        raise ValueError("targets started by compare need --model-id")
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"target names must be unique: {names}")
    if alternate and any(t.metrics_urls for t in targets):
        raise ValueError("--alternate reads each target's own /metrics: give routers without @replicas")
    if alternate and cfg.concurrency != 1:
        raise ValueError(f"--alternate sends one request at a time: pass --concurrency 1 (got {cfg.concurrency})")
    started = dict(model_id=model_id, server_cmd=server_cmd, log_dir=log_dir, startup_timeout=startup_timeout,
                   ports=ports)
    out = []
    if alternate:
        with contextlib.ExitStack() as stack:  # every server up before the first request
            urls = [_url(t, stack, **started) for t in targets]
            out = list(zip(targets, alternate_runs.run(requests, cfg, urls)))
        for t, res in out:
            if on_result is not None:
                on_result(t, res)
        return out
    for t in targets:
        with contextlib.ExitStack() as stack:  # a started server lives only through its own run
            res = client.run(requests, replace(cfg, url=_url(t, stack, **started), metrics_urls=t.metrics_urls))
        if on_result is not None:
            on_result(t, res)
        out.append((t, res))
    return out

"""Load-test tool, failure paths: /metrics deltas across a server restart, servers started by
`compare` stopped on every exit (startup failure, Ctrl-C, SIGTERM), errors that must not end a
run, and the CLI's bounds on its numeric flags."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadtest import cli, client, compare, scrape, workloads
from loadtest.datasets import synthetic

ROOT = Path(__file__).resolve().parents[1]


def _prom(*, count: float, total: float, orig: float | None, comp: float | None, created: float | None) -> str:
    lines = ["# TYPE te_radix_mlp_compression_ratio histogram",
             f'te_radix_mlp_compression_ratio_bucket{{le="+Inf"}} {count}',
             f"te_radix_mlp_compression_ratio_count {count}", f"te_radix_mlp_compression_ratio_sum {total}"]
    if created is not None:
        lines.append(f"te_radix_mlp_compression_ratio_created {created}")
    lines.append("# TYPE radixserve_tokens_total counter")
    for kind, v in (("original", orig), ("compact", comp)):
        if v is not None:
            lines.append(f'radixserve_tokens_total{{kind="{kind}"}} {v}')
    return "\n".join(lines) + "\n"


def test_delta_same_process():
    before = scrape.parse(_prom(count=4, total=2.0, orig=None, comp=None, created=100.0))
    after = scrape.parse(_prom(count=10, total=5.0, orig=900.0, comp=300.0, created=100.0))
    d = scrape.delta(before, after)
    assert d.batches == 10 - 4 and d.mean_ratio == pytest.approx((5.0 - 2.0) / (10 - 4))
    # Labelled counters first appear on their first increment: absent before means 0 then.
    assert d.tokens_original == 900.0 and d.tokens_compact == 300.0
    assert d.token_ratio == pytest.approx(300.0 / 900.0)


@pytest.mark.parametrize("created_after", [100.0, 250.0, None])
def test_delta_unknown_after_a_server_restart(created_after):
    """A restarted server starts its counters again: no negative or mixed figures."""
    before = scrape.parse(_prom(count=50, total=25.0, orig=5000.0, comp=2000.0, created=100.0))
    if created_after == 100.0:  # no _created change, but every counter went down
        after = scrape.parse(_prom(count=3, total=1.0, orig=300.0, comp=100.0, created=100.0))
    else:  # a new process that already counted past the old values
        after = scrape.parse(_prom(count=80, total=40.0, orig=8000.0, comp=3000.0, created=created_after))
    d = scrape.delta(before, after)
    assert (d.batches, d.mean_ratio, d.tokens_original, d.tokens_compact) == (None, None, None, None)
    assert d.token_ratio is None


def test_delta_without_created_series():
    """Servers without _created (the peer baseline) still get deltas, and resets still show."""
    before = scrape.parse(_prom(count=0, total=0, orig=100.0, comp=None, created=None))
    after = scrape.parse(_prom(count=0, total=0, orig=350.0, comp=None, created=None))
    assert scrape.delta(before, after).tokens_original == 250.0
    assert scrape.delta(after, before).tokens_original is None


SAFETY_S = 600  # a bound on waits for a process event: catches a hang only (a busy box takes minutes)


def _sleeper_argv(pid_file: Path) -> list[str]:
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(3600)"
    return [sys.executable, "-c", code]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_for(path: Path, timeout: float = 600.0) -> int:
    deadline = time.monotonic() + timeout  # catches a hang only: the file appearing is the event
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(path)


def test_managed_server_stopped_when_startup_is_interrupted(tmp_path, monkeypatch):
    """Ctrl-C while waiting for /health stops the server and stays a KeyboardInterrupt."""
    def interrupted(url, *, timeout, alive):
        _wait_for(tmp_path / "pid")
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "wait_healthy", interrupted)
    srv = compare.ManagedServer(_sleeper_argv(tmp_path / "pid"), port=9, log_path=tmp_path / "s.log",
                                startup_timeout=5)
    with pytest.raises(KeyboardInterrupt):
        srv.__enter__()
    assert srv.proc.poll() is not None


def test_managed_server_stopped_when_the_run_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(client, "wait_healthy", lambda url, *, timeout, alive: None)
    with pytest.raises(KeyboardInterrupt):
        with compare.ManagedServer(_sleeper_argv(tmp_path / "pid"), port=9, log_path=tmp_path / "s.log",
                                   startup_timeout=5) as srv:
            _wait_for(tmp_path / "pid")
            raise KeyboardInterrupt
    assert srv.proc.poll() is not None


def test_managed_server_that_exits_early_is_an_error(tmp_path):
    argv = [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    # it exits first: that ends the wait (the bound catches a hang only)
    srv = compare.ManagedServer(argv, port=compare.free_port(), log_path=tmp_path / "s.log", startup_timeout=SAFETY_S)
    with pytest.raises(RuntimeError, match="boom"):
        srv.__enter__()
    assert srv.proc.returncode == 3
    missing = compare.ManagedServer([str(tmp_path / "no-such-server")], port=9, log_path=tmp_path / "m.log",
                                    startup_timeout=1)
    with pytest.raises(RuntimeError, match="did not start"):
        missing.__enter__()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_compare_stops_its_server_when_signalled(tmp_path, sig):
    """`radixserve-loadtest compare` killed by SIGTERM or Ctrl-C leaves no server behind."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(3600)"
    server_cmd = f"{sys.executable} -c {code!r}"
    argv = [sys.executable, "-m", "loadtest.cli", "compare", "--model-id", str(tmp_path), "--server", "a:",
            "--server-cmd", server_cmd, "--source", "synthetic", "--queries", "2", "--startup-timeout", "3600",
            "--no-progress", "--out", str(tmp_path / "out")]
    # A Ctrl-C at a terminal reaches a process whose SIGINT is the default. A run started in the
    # background of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: compare would rightly ignore the signal. The child
    # gets the terminal's disposition whatever this run inherited.
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=_default_sigint)
    server_pid = None
    try:
        server_pid = _wait_for(pid_file)
        proc.send_signal(sig)
        proc.wait(timeout=SAFETY_S)  # compare exiting is the event; the bound catches a hang only
        deadline = time.monotonic() + SAFETY_S
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server_pid), "the started server outlived compare"
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=SAFETY_S)
        if server_pid is not None and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_log_name_stays_in_the_log_dir():
    for name in ("../../etc/x", "a b/c", ".hidden", "ok-name_1.2"):
        log = compare.log_name(name)
        assert "/" not in log and log.startswith("server-") and log.endswith(".log")
        assert (Path("/logs") / log).parent == Path("/logs")
    assert compare.log_name("ok-name_1.2") == "server-ok-name_1.2.log"


def test_undecodable_answers_are_counted_not_fatal(monkeypatch):
    async def broken_post(self, url, **kw):
        raise httpx.DecodingError("bad gzip stream")

    monkeypatch.setattr(httpx.AsyncClient, "post", broken_post)
    reqs = workloads.build_requests(synthetic(3, seed=1), "rerank")
    res = client.run(reqs, client.RunConfig(url="http://127.0.0.1:9", concurrency=2, requests=5, warmup=1,
                                            progress=False, timeout=2))
    assert res.sent == 5 and res.ok == 0 and dict(res.errors) == {"bad-response": 5}


@pytest.mark.parametrize("flags", [
    ["--concurrency", "0"], ["--requests", "0"], ["--requests", "-3"], ["--duration", "0"],
    ["--duration", "nan"], ["--warmup", "-1"], ["--timeout", "-5"], ["--queries", "0"],
])
def test_cli_rejects_values_that_would_not_run(flags, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["run", "--url", "http://127.0.0.1:9", *flags])
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err
    ok = cli.build_parser().parse_args(["run", "--url", "http://127.0.0.1:9", "--warmup", "0", "--duration", "0.5"])
    assert ok.warmup == 0 and ok.duration == 0.5

"""The host ceiling: the real server with a zero-cost forward, so what is measured is everything else.

    python -m benchmarks.host_ceiling [--loads embed-template rerank one-input] [--duration 4]
        [--requests N] [--cache default 0] [--api-servers 1 2] [--rounds 6] [--json]
        [--checkout before=/path/to/other/clone --checkout after=.]

Each server is the real CLI (``server.cli.main``: HTTP stack, JSON, tokenization, scheduler,
trie, prefix cache plan and commit) in a subprocess, on the tiny fixtures, with the runner's
``forward`` replaced by one that returns zeros of the right shape: the model never runs, every
other part of ``Runner.run`` does. The loads are the load tester's own (``loadtest.workloads``,
``loadtest.client``): ``embed-template`` (64 templated pairs per /v1/embeddings request, ~9.2k
tokens), ``rerank`` (one query with 100 passages per /rerank request) and ``one-input`` (one query
per /embed request), closed loop at ``--concurrency``. One server per fixture and ``--cache``
setting (and ``--api-servers`` count: the server's ``--api-server-count``) is started up front; the
settings then alternate load by load, round by round, so the figures sit side by side under the
same machine load.

Printed per load and cache setting: wall input tokens/s and items/s, the server process's
CPU-seconds per 1M input tokens, whole and per thread (``loop``: the event loop, ``tokenizer``:
the tokenization pool, ``prep``, ``worker``, ``settle``; ``native``: threads Python did not start,
such as the tokenizers' and torch's own, which run without the GIL; ``other``: the rest, threads
that ended included), and the worker thread's CPU time per batch outside the forward (a small
batch at an idle pipeline runs on the prep thread instead: ``worker batches`` counts the others).
Per-thread CPU time is read in the server process through an opt-in hook (``--serve-child``,
answering "stats" on stdin: the server side, benchmarks/host_child.py) from each thread's CPU
clock (``time.pthread_getcpuclockid``). Last, each setting against the first of its load, round
by round (the two ran one right after the other, so a slow spell of the machine mostly cancels
in their ratio), with the median. With ``--checkout NAME=DIR`` (repeatable) every
setting runs once per checkout, each server started from that directory (its own code, the same
Python and fixtures), so two commits are compared side by side; the child hook it needs is in every
checkout that has this file. With front-end processes (``--api-servers``
above 1) the threads are the engine's; each front end's CPU time is read from /proc (its
utime + stime) and reported per process (``frontends``: their sum, ``each``: per front end), and
``all`` is the engine's plus theirs. Nothing is asserted; the figures are in
docs/performance/host.md, "Host path".
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from benchmarks.host_child import GROUPS, PREFIX, TICK_S, group_of, serve_child
from benchmarks.paired_rounds import paired, paired_table
from loadtest import machine


@dataclass(frozen=True)
class Load:
    preset: str
    workload: str
    passages: tuple[int, int] | None = None  # synthetic passages per query (None: the dataset's default)
    queries_per_s: int = 1000  # synthetic queries built per second of measured run: none is sent twice


LOADS = {
    "embed-template": Load("tiny-embedding", "embed-template", queries_per_s=1000),
    "rerank": Load("tiny-reranker", "rerank", passages=(100, 100), queries_per_s=150),
    "one-input": Load("tiny-embedding", "embed-query", queries_per_s=2000),
}


# ---- the load side (this process) --------------------------------------------------------------

class Server:
    """One child server: ``stats()`` asks it for its CPU clocks."""

    def __init__(self, preset: str, cache: str, port: int, extra: list[str], *, log: bool = False,
                 api_servers: int = 1, checkout: str = "") -> None:
        import fixtures

        model = str(fixtures.cached(preset))
        self.name, self.url = f"{preset} cache={cache} api-servers={api_servers}", f"http://127.0.0.1:{port}"
        env = None
        if checkout:  # the server runs that directory's code
            env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
        self.api_servers = api_servers
        argv = ["--model-id", model, "--hostname", "127.0.0.1", "--port", str(port),
                "--prefix-cache-size", cache, *extra]
        if api_servers > 1:
            argv += ["--api-server-count", str(api_servers)]
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.host_ceiling", "--serve-child", *argv],
                                     cwd=os.path.abspath(checkout) if checkout else None, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     stderr=None if log else subprocess.DEVNULL)

    def wait(self) -> None:
        from loadtest.client import wait_healthy

        wait_healthy(self.url, timeout=300.0, alive=lambda: self.proc.poll() is None)
        if self.api_servers > 1:  # until every front end serves (a new connection lands on any)
            import httpx

            seen: set[str] = set()
            deadline = time.monotonic() + 300.0
            while len(seen) < self.api_servers and time.monotonic() < deadline:
                seen.add(httpx.get(self.url + "/health", timeout=30).headers.get("x-radixserve-frontend", ""))

    def stats(self) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return {**json.loads(line[len(PREFIX):]), "frontends_cpu_s": children_cpu_s(self.proc.pid)}
        raise RuntimeError(f"{self.name} exited (status {self.proc.wait()})")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def children_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime, every thread) of each child process of ``pid``: the front ends."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out[entry] = (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def requests_of(load: Load, queries: int):
    from loadtest import datasets, workloads

    kw = {"passages_per_query": load.passages} if load.passages else {}
    return workloads.build_requests(datasets.synthetic(queries, seed=0, **kw), load.workload)


def figures(before: dict, after: dict, *, tokens: float, items: int, wall_s: float) -> dict:
    """One measured run's figures from the server's CPU clocks before and after it."""
    per_group = dict.fromkeys(GROUPS, 0.0)
    for key, cpu in after["threads"].items():
        per_group[group_of(key.rsplit(":", 1)[0])] += cpu - before["threads"].get(key, 0.0)
    total = after["process_cpu_s"] - before["process_cpu_s"]
    per_group["other"] += total - sum(per_group.values())  # threads that ended between the clocks
    batches = after["forwards"] - before["forwards"]
    on_worker = after["worker_forwards"] - before["worker_forwards"]
    forward_cpu = after["worker_forward_cpu_s"] - before["worker_forward_cpu_s"]
    per_m = 1e6 / tokens if tokens else float("nan")
    fronts = {pid: cpu - before.get("frontends_cpu_s", {}).get(pid, 0.0)
              for pid, cpu in after.get("frontends_cpu_s", {}).items()}
    return {
        "tokens": int(tokens), "items": items, "wall_s": round(wall_s, 4),
        "tokens_per_s": round(tokens / wall_s), "items_per_s": round(items / wall_s, 1),
        "batches": batches, "tokens_per_batch": round(tokens / batches) if batches else 0,
        "cpu_s_per_1m_tokens": round(total * per_m, 3),
        "cpu_s_per_1m_tokens_by_thread": {g: round(v * per_m, 3) for g, v in per_group.items()},
        "worker_batches": on_worker,
        "worker_non_forward_ms_per_batch": round((per_group["worker"] - forward_cpu) / on_worker * 1e3, 3)
        if on_worker else None,
        "frontends_cpu_s_per_1m_tokens": round(sum(fronts.values()) * per_m, 3),
        "frontends_cpu_s_per_1m_tokens_each": [round(v * per_m, 3) for _, v in sorted(fronts.items())],
        "all_cpu_s_per_1m_tokens": round((total + sum(fronts.values())) * per_m, 3),
    }


def measure(server: Server, reqs, *, concurrency: int, duration: float | None, requests: int | None) -> dict:
    """One closed-loop run of ``reqs`` (two unmeasured warm-up requests first) against ``server``."""
    from loadtest.client import RunConfig, run

    cfg = RunConfig(url=server.url, concurrency=concurrency, duration=duration, requests=requests,
                    warmup=2, progress=False, warmup_continues=True)
    before = server.stats()
    res = run(reqs, cfg)
    after = server.stats()
    tokens = res.metrics.tokens_original or 0.0
    out = figures(before, after, tokens=tokens, items=res.items_ok, wall_s=res.wall_s)
    # a request sent twice may be read whole from the prefix cache: the figure is then flattered
    out.update(errors=dict(res.errors), sent=res.sent + cfg.warmup, repeated=res.sent > res.distinct)
    return out


def merge(runs: list[dict]) -> dict:
    """Rounds of one (load, cache) summed into one figure set."""
    if len(runs) == 1:
        return runs[0]
    tokens = sum(r["tokens"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    batches = sum(r["batches"] for r in runs)
    on_worker = sum(r["worker_batches"] for r in runs)
    w = [r["tokens"] / tokens if tokens else 0.0 for r in runs]
    by = {g: round(sum(x * r["cpu_s_per_1m_tokens_by_thread"][g] for x, r in zip(w, runs)), 3) for g in GROUPS}
    bw = [r["worker_batches"] / on_worker if on_worker else 0.0 for r in runs]
    errors: dict = {}
    for r in runs:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return {
        "tokens": tokens, "items": sum(r["items"] for r in runs), "wall_s": round(wall, 4),
        "tokens_per_s": round(tokens / wall), "items_per_s": round(sum(r["items"] for r in runs) / wall, 1),
        "batches": batches, "tokens_per_batch": round(tokens / batches) if batches else 0,
        "cpu_s_per_1m_tokens": round(sum(x * r["cpu_s_per_1m_tokens"] for x, r in zip(w, runs)), 3),
        "cpu_s_per_1m_tokens_by_thread": by, "worker_batches": on_worker,
        "worker_non_forward_ms_per_batch": round(sum(x * r["worker_non_forward_ms_per_batch"]
                                                     for x, r in zip(bw, runs) if x), 3)
        if on_worker else None,
        "errors": errors, "rounds": len(runs), "repeated": any(r["repeated"] for r in runs),
        **{k: round(sum(x * r[k] for x, r in zip(w, runs)), 3)
           for k in ("frontends_cpu_s_per_1m_tokens", "all_cpu_s_per_1m_tokens")},
        "frontends_cpu_s_per_1m_tokens_each": [round(sum(x * r["frontends_cpu_s_per_1m_tokens_each"][i]
                                                         for x, r in zip(w, runs)), 3)
                                               for i in range(min(len(r["frontends_cpu_s_per_1m_tokens_each"])
                                                                  for r in runs))],
    }


def host_ceiling(loads: list[str], caches: list[str], *, rounds: int = 6, duration: float | None = 4.0,
                 requests: int | None = None, concurrency: int = 8, queries: int | None = None,
                 extra: list[str] | None = None, log: bool = False, api_servers: tuple[int, ...] = (1,),
                 checkouts: dict[str, str] | None = None) -> list[dict]:
    """One row per (checkout, load, cache setting, front-end count): the figures of ``figures``,
    summed over the rounds. ``checkouts`` maps a name to a directory whose code a server runs
    (none: this one's)."""
    trees = checkouts or {"": ""}
    arms = [(tree, cache, n) for tree in trees for cache in caches for n in api_servers]
    servers: dict[tuple[str, tuple[str, str, int]], Server] = {}
    try:
        for preset in dict.fromkeys(LOADS[name].preset for name in loads):
            for tree, cache, n in arms:
                servers[(preset, (tree, cache, n))] = Server(preset, cache, free_port(), list(extra or []),
                                                             log=log, api_servers=n, checkout=trees[tree])
        for s in servers.values():
            s.wait()
        seconds = duration if duration is not None else max(1.0, (requests or 0) / 10)
        reqs = {name: requests_of(LOADS[name], queries or int(LOADS[name].queries_per_s * seconds * rounds))
                for name in loads}
        got: dict[tuple[str, tuple[str, str, int]], list[dict]] = {(n, a): [] for n in loads for a in arms}
        sent = dict.fromkeys(got, 0)  # each server walks its own way through the list: no request twice
        for r in range(rounds):
            for name in loads:
                order = arms if r % 2 == 0 else arms[::-1]  # who goes first alternates
                for arm in order:
                    rest = reqs[name][sent[(name, arm)]:]
                    row = measure(servers[(LOADS[name].preset, arm)], rest if len(rest) > 2 else reqs[name],
                                  concurrency=concurrency, duration=duration, requests=requests)
                    sent[(name, arm)] += row.pop("sent")
                    got[(name, arm)].append(row)
    finally:
        for s in servers.values():
            s.stop()
    return [{"load": n, **({"checkout": t} if t else {}), "prefix_cache_size": c, "api_server_count": k,
             **merge(runs),
             "per_round": [{key: r[key] for key in ("all_cpu_s_per_1m_tokens", "tokens_per_s")} for r in runs]}
            for (n, (t, c, k)), runs in got.items()]


def table(rows: list[dict]) -> str:
    head = ["load", "checkout", "cache", "api servers", "tok/s", "items/s", "batches", "tok/batch", "CPU-s/1M", *GROUPS,
            "worker batches", "worker ms/batch", "frontends CPU-s/1M (each)", "all CPU-s/1M"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if r["repeated"]:
            lines.append(f"(the {r['load']} list ran out and repeated: --queries more)")
        by = r["cpu_s_per_1m_tokens_by_thread"]
        lines.append(" | ".join(str(x) for x in [
            r["load"], r.get("checkout", "."), r["prefix_cache_size"], r["api_server_count"], r["tokens_per_s"], r["items_per_s"],
            r["batches"], r["tokens_per_batch"], r["cpu_s_per_1m_tokens"], *(by[g] for g in GROUPS),
            r["worker_batches"], r["worker_non_forward_ms_per_batch"],
            f"{r['frontends_cpu_s_per_1m_tokens']} ({', '.join(map(str, r['frontends_cpu_s_per_1m_tokens_each']))})",
            r["all_cpu_s_per_1m_tokens"]]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-child"]:
        return serve_child(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_ceiling", description=__doc__.split("\n")[0])
    ap.add_argument("--loads", nargs="+", choices=sorted(LOADS), default=list(LOADS))
    ap.add_argument("--cache", nargs="+", default=["default", "0"], metavar="SIZE",
                    help="--prefix-cache-size of each server, alternated ('default': the server's default)")
    ap.add_argument("--api-servers", nargs="+", type=int, default=[1], metavar="N",
                    help="--api-server-count of each server, alternated (1: one process; N: N front ends and the engine)")
    ap.add_argument("--rounds", type=int, default=6,
                    help="measured runs per load and setting (short runs, many rounds: steadier paired ratios)")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per measured run")
    ap.add_argument("--requests", type=int, default=None, help="requests per measured run (instead of --duration)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--queries", type=int, default=None,
                    help="synthetic queries the requests are built from (default: enough that none repeats)")
    ap.add_argument("--log", action="store_true", help="show the servers' logs (stderr)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra server flag, repeatable (e.g. --server-arg=--max-batch-tokens --server-arg=32768)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row instead of the table")
    ap.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR",
                    help="run every setting from this checkout's code too, alternated (repeatable; the "
                         "first is the base of the paired ratios)")
    a = ap.parse_args(argv)
    checkouts = dict(c.split("=", 1) for c in a.checkout) or None
    from server.config import ServerConfig

    caches = [ServerConfig.prefix_cache_size if c == "default" else c for c in a.cache]
    host = machine.current()
    rows = host_ceiling(a.loads, caches, rounds=a.rounds, duration=None if a.requests else a.duration,
                        requests=a.requests, concurrency=a.concurrency, queries=a.queries,
                        extra=a.server_arg, log=a.log, api_servers=tuple(a.api_servers),
                        checkouts=checkouts)
    pairs, host = paired(rows), machine.finish(host)
    if a.json:
        print("\n".join(json.dumps(r) for r in [*rows, *pairs, {"machine": host}]))
    else:
        print(f"machine: {machine.line(host)}")
        print(table(rows))
        if pairs:
            print(paired_table(pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

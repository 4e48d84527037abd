"""The HTTP steps: one arm under load, the load client's ceiling, the latency floor of one short
request and of a 10-pair rerank, and the host's tokenizing ceiling.

Every arm of a phase replays the same request list (embed-template pairs, 64 per /v1/embeddings
request, base64 answers) from its start; the list is long enough that the fastest arm ends
(`requests` cap) before it would repeat one, and the warm-up's requests are not sent again.
"""
from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

from benchmarks.gpu_campaign import plan
from benchmarks.gpu_campaign.gpu_busy import BusySampler
from loadtest import client, compare, datasets, report, responder, workloads


def request_list(s: plan.Sizes, duration: float, work: Path) -> list[workloads.Request]:
    """The phase's request list, built once and kept in the work folder (never in the logs)."""
    queries = plan.queries_for(s, duration)
    path = work / f"requests-{queries}.pkl"
    if path.is_file():
        return pickle.loads(path.read_bytes())
    ds = datasets.synthetic(queries, seed=0)
    reqs = workloads.build_requests(ds, "embed-template", encoding="base64")
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(reqs))
    tmp.rename(path)
    return reqs


def run_config(s: plan.Sizes, reqs: list, duration: float, url: str = "http://127.0.0.1") -> client.RunConfig:
    """Concurrency 32, `duration` seconds, capped at the list's end; warm-up requests not repeated."""
    return client.RunConfig(url=url, concurrency=plan.CONCURRENCY, requests=len(reqs) - s.warmup,
                            duration=duration, warmup=s.warmup, timeout=300.0, progress=False,
                            warmup_continues=True)


def _summary(res: client.RunResult, name: str, **meta) -> dict:
    out = report.summarize(res, name=name, meta=meta)
    out.pop("latencies_ms", None)  # the table needs p50 and mean; the tarball keeps the logs
    return out


def _server(model_dir: Path, name: str, flags: list[str], logs: Path, startup_s: float):
    port = compare.free_port()
    argv = compare.server_command(compare.Target(name=name, flags=tuple(flags)), model_id=str(model_dir),
                                  port=port, server_cmd=None)
    return compare.ManagedServer(argv, port=port, log_path=logs / compare.log_name(name), startup_timeout=startup_s)


def arm(s: plan.Sizes, model_dir: Path, *, arm: str, duration: float, logs: Path, work: Path,
        deadline_at: float, role: str) -> dict:
    """One arm: its server up, the load for `duration` s (less if the deadline is nearer), down."""
    reqs = request_list(s, duration, work)
    flags = plan.server_flags(arm, s)
    t0 = time.monotonic()
    with _server(model_dir, f"{role}-{arm}", flags, logs, startup_s=max(10.0, deadline_at - time.time())) as srv:
        startup = time.monotonic() - t0
        left = deadline_at - time.time() - 15.0  # the scrape after the run and the server's stop
        run_s = max(1.0, min(duration, left))
        with BusySampler(s.device) as busy:
            res = client.run(reqs, run_config(s, reqs, run_s, srv.url))
    out = _summary(res, arm, flags=" ".join(plan.ARMS[arm]), cache=plan.CACHE_STATE[arm],
                   startup_s=round(startup, 1), duration=run_s)
    out["gpu_busy"] = busy.share
    return out


def ceiling(s: plan.Sizes, *, role: str, duration: float, work: Path, workers: int) -> dict:
    """The load client against a responder that does no work: the fastest rate it can measure."""
    reqs = request_list(s, plan.duration(s, role), work)
    res = responder.measure_ceiling(reqs, run_config(s, reqs, duration), dims=s.dims[role], workers=workers)
    return _summary(res, "client ceiling")


def _short_requests(n: int) -> list[workloads.Request]:
    """n distinct one-input /embed requests of a few words (never a prefix-cache repeat)."""
    words = datasets.synthetic(n, seed=1).samples
    return [workloads.Request("/embed", {"inputs": [f"{i} {smp.query}"]}, 1) for i, smp in enumerate(words)]


def floor(s: plan.Sizes, model_dir: Path, *, kind: str, logs: Path, deadline_at: float) -> dict:
    """Concurrency 1 latency on the shipped defaults (the device's dtype, radix `auto`-gated, cache
    auto): one short /embed input, or one 10-pair /rerank, each request distinct."""
    n = s.floor_requests
    if kind == "reranker":
        reqs = workloads.build_requests(datasets.synthetic(n + 2, seed=2), "rerank", batch_size=10)[: n + 2]
        name = "rerank 10 pairs"
    else:
        reqs = _short_requests(n + 2)
        name = "embed 1 short input"
    flags = ["--device", s.device, "--dtype", s.dtype, "--max-batch-tokens", str(plan.MAX_BATCH_TOKENS)]
    with _server(model_dir, f"floor-{kind}", flags, logs, startup_s=max(10.0, deadline_at - time.time())) as srv:
        cfg = client.RunConfig(url=srv.url, concurrency=1, requests=n, warmup=2, progress=False,
                               warmup_continues=True, duration=max(1.0, deadline_at - time.time() - 15.0))
        res = client.run(reqs, cfg)
    return _summary(res, name, flags=" ".join(flags), concurrency=1)


def host(s: plan.Sizes, model_dir: Path, *, work: Path, threads: int) -> dict:
    """Items/s the host's cores tokenize (the server's tokenizer, `threads` at once): the most the
    server can take in, whatever the GPU does."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    reqs = request_list(s, s.duration, work)[:400]
    texts = [r.body["input"] for r in reqs]
    tok.encode_batch(texts[0])  # warm
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        tokens = sum(pool.map(lambda batch: sum(len(e.ids) for e in tok.encode_batch(batch)), texts))
    spent = time.perf_counter() - t0
    items = sum(len(t) for t in texts)
    return {"name": "host tokenizing", "threads": threads, "items": items, "items_per_s": items / spent,
            "tokens_per_s": tokens / spent}


def frontends(s: plan.Sizes, *, logs: Path, deadline_at: float) -> dict:
    """benchmarks.host_ceiling on this host's cores: the server with a zero-cost forward, one
    process against ``--api-server-count`` front ends (4 on a GPU host), one-input and
    embed-template requests, alternating. Shows whether the front ends scale where cores are free."""
    import subprocess
    import sys

    cuda = s.device.startswith("cuda")
    n = 4 if cuda else 2
    argv = [sys.executable, "-m", "benchmarks.host_ceiling", "--loads", "one-input", "embed-template",
            "--cache", "default", "--api-servers", "1", str(n), "--rounds", "1", "--json",
            "--duration", "8" if cuda else "1", "--concurrency", "32" if cuda else "4"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=max(10.0, deadline_at - time.time()))
    (logs / "frontends.out").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"host_ceiling exited {res.returncode}: {res.stderr[-400:]}")
    keys = ("load", "api_server_count", "tokens_per_s", "items_per_s", "cpu_s_per_1m_tokens",
            "frontends_cpu_s_per_1m_tokens", "all_cpu_s_per_1m_tokens")
    rows = [{k: r[k] for k in keys} for r in map(json.loads, res.stdout.splitlines()) if "api_server_count" in r]
    return {"cores": os.cpu_count(), "rows": rows}

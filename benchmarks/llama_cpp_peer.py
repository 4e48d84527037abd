"""radixserve against llama.cpp's llama-server on a CPU, side by side: throughput, latency, accuracy.

    python -m benchmarks.llama_cpp_peer --model-dir DIR --llama-server BIN \\
        --gguf f32=F32.gguf --gguf q8_0=Q8_0.gguf [--items 8] [--parallel 8] [--json PATH]

Every server is up at once: ours from `--ours NAME=FLAGS` (default: `compact` with the default
flags, `bf16` with `--cpu-weights bf16`, `int8` with `--cpu-weights int8`), and one llama-server
per `--gguf NAME=PATH` (`llama-server --embedding --pooling last -t THREADS -np PARALLEL -b 4096
-ub 4096 -kvu -c PARALLEL*CTX_PER_SLOT`). Then:

1. **Checks**: on a few texts of each load, each llama-server's token ids (/tokenize) against
   ours, and every arm's /v1/embeddings against the first `--ours` arm (fp32 weights) as cosines.
2. **Loads** (`--loads`), each through loadtest.alternate (concurrency 1, the arms taking turns
   request by request, in a shuffled order each round), warm-up requests unmeasured and never repeated:
   - `template`: `--items` Qwen3-Reranker pairs per /v1/embeddings request (loadtest's
     `embed-template`: system prompt, instruction and query shared across a query's pairs);
   - `documents`: `--items` unrelated passages per request (loadtest's `embed`: nothing shared);
   - `query`: one instructed query per request (Qwen3-Embedding's query prompt + the query),
     where p50 latency is the figure.
   Each prints items/s, p50 and p99, and every arm's ratio against each llama.cpp arm (items/s:
   ours / theirs, > 1 is faster; p50: ours / theirs, < 1 is faster).

The data is loadtest's synthetic MS MARCO-shaped set. Servers log to `--log-dir`. Nothing is
asserted: the figures and the command go to docs/performance/cpu.md ("Against llama.cpp").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import llama_cpp_check as check
from loadtest import alternate, client, compare, datasets, machine, report, workloads

LOADS = ("template", "documents", "query")
DEFAULT_OURS = ("compact=", "bf16=--cpu-weights bf16", "int8=--cpu-weights int8")
DEFAULT_REQUESTS = {"template": 3, "documents": 3, "query": 20}
CHECK_TEXTS_PER_LOAD = 2


@dataclass(frozen=True)
class Arm:
    name: str
    argv: tuple[str, ...]  # the server's command without --port (ours: without --model-id either)
    llama: bool


def parse_pair(spec: str, what: str) -> tuple[str, str]:
    """`NAME=VALUE` -> (NAME, VALUE); ValueError naming `what` otherwise."""
    name, sep, value = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"{what} wants NAME=VALUE, got {spec!r}")
    return name.strip(), value.strip()


def llama_argv(binary: str, gguf: str, *, threads: int, parallel: int, ctx_per_slot: int,
               batch: int = 4096) -> list[str]:
    """llama-server serving `gguf` as a last-token-pooled embedding model on 127.0.0.1.

    `-kvu` (one KV buffer for all slots): with a buffer per slot, llama.cpp cuts a batch of several
    sequences into ubatches of equally many tokens from each, so inputs of different lengths run as
    many small ubatches, each reading every weight (1.4-2.6x slower on 8 passages than with `-kvu`)."""
    return [*shlex.split(binary), "-m", gguf, "--host", "127.0.0.1", "--embedding", "--pooling", "last",
            "-t", str(threads), "-np", str(parallel), "-kvu", "-b", str(batch), "-ub", str(batch),
            "-c", str(parallel * ctx_per_slot)]


def arms_from(args: argparse.Namespace) -> list[Arm]:
    """Ours first (the first is the accuracy reference), then one llama.cpp arm per --gguf."""
    arms = []
    for spec in args.ours or DEFAULT_OURS:
        name, flags = parse_pair(spec, "--ours")
        arms.append(Arm(name, tuple(shlex.split(flags)), llama=False))
    for spec in args.gguf:
        name, path = parse_pair(spec, "--gguf")
        if not Path(path).is_file():
            raise ValueError(f"--gguf {name}: no such file {path}")
        argv = llama_argv(args.llama_server, path, threads=args.threads, parallel=args.parallel,
                          ctx_per_slot=args.ctx_per_slot)
        arms.append(Arm(f"llama-{name}", tuple(argv), llama=True))
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique: {names}")
    return arms


def load_requests(load: str, dataset: datasets.Dataset, *, items: int, count: int) -> list[workloads.Request]:
    """The first `count` requests of `load` (ValueError when the dataset holds fewer)."""
    if load == "template":
        reqs = workloads.build_requests(dataset, "embed-template", batch_size=items)
    elif load == "documents":
        reqs = workloads.build_requests(dataset, "embed", batch_size=items)
    elif load == "query":
        prompt = workloads.query_prompt()
        reqs = [workloads.Request("/v1/embeddings", {"input": [prompt + s.query]}, 1) for s in dataset.samples]
    else:
        raise ValueError(f"unknown load {load!r}; choose from {', '.join(LOADS)}")
    reqs = [r for r in reqs if r.items == (1 if load == "query" else items)]  # no short last request
    if len(reqs) < count:
        raise ValueError(f"load {load}: the dataset gives {len(reqs)} requests, {count} wanted")
    return reqs[:count]


def check_texts(dataset: datasets.Dataset) -> list[str]:
    """A few texts of each load's kind, from the end of the dataset (the loads' requests are taken
    from its head, so with the default sizes no check text is a measured one)."""
    tail = dataset.samples[-CHECK_TEXTS_PER_LOAD:]
    prompt = workloads.query_prompt()
    return ([workloads.render_pair(s.query, s.passages[0]) for s in tail] + [s.passages[-1] for s in tail]
            + [prompt + s.query for s in tail])


def ratio_rows(summaries: list[dict], llama_names: list[str]) -> list[dict]:
    """Per arm: items/s and p50 against each llama.cpp arm (ours / theirs)."""
    by_name = {s["name"]: s for s in summaries}
    rows = []
    for s in summaries:
        row: dict = {"name": s["name"], "items_per_s": s["items_per_s"], "p50_ms": s["latency_ms"]["p50"],
                     "p99_ms": s["latency_ms"]["p99"], "errors": s["error_count"]}
        for ln in llama_names:
            ref = by_name[ln]
            row[f"items_vs_{ln}"] = report._ratio(s["items_per_s"], ref["items_per_s"])
            row[f"p50_vs_{ln}"] = report._ratio(s["latency_ms"]["p50"], ref["latency_ms"]["p50"])
        rows.append(row)
    return rows


def markdown_table(rows: list[dict], llama_names: list[str]) -> str:
    f = report._f
    head = ["arm", "items/s", "p50 ms", "p99 ms"] + [f"items/s vs {n}" for n in llama_names] + [
        f"p50 vs {n}" for n in llama_names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"] + (f" ({r['errors']} errors)" if r["errors"] else ""), f(r["items_per_s"], "{:.2f}"),
                 f(r["p50_ms"], "{:.0f}"), f(r["p99_ms"], "{:.0f}")]
        cells += [f(r[f"items_vs_{n}"], "{:.2f}x") for n in llama_names]
        cells += [f(r[f"p50_vs_{n}"], "{:.2f}x") for n in llama_names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def start(stack: contextlib.ExitStack, arms: list[Arm], *, model_dir: str, log_dir: Path,
          server_cmd: str | None = None, startup_timeout: float = 600.0) -> dict[str, str]:
    """Start every arm on a free loopback port, each healthy before the next starts; stopped when
    `stack` closes. Returns {arm name: URL}."""
    urls = {}
    for a in arms:
        port = compare.pick_port(None)
        argv = ([*a.argv, "--port", str(port)] if a.llama else compare.server_command(
            compare.Target(a.name, flags=a.argv), model_id=model_dir, port=port, server_cmd=server_cmd))
        print(f"[{a.name}] starting: {shlex.join(argv)}", file=sys.stderr)
        srv = compare.ManagedServer(argv, port=port, log_path=log_dir / compare.log_name(a.name),
                                    startup_timeout=startup_timeout)
        urls[a.name] = stack.enter_context(srv).url
    return urls


def run_checks(urls: dict[str, str], arms: list[Arm], texts: list[str]) -> dict:
    """Token ids of every llama arm against ours, cosines of every arm against the first."""
    ref = arms[0].name
    ours_ids = check.our_token_ids(urls[ref], texts)
    ref_vecs = check.embeddings(urls[ref], texts)
    out: dict = {"reference": ref, "texts": len(texts), "tokens": {}, "cosine": {}}
    for a in arms:
        if a.llama:
            out["tokens"][a.name] = check.compare_tokens(ours_ids, check.llama_token_ids(urls[a.name], texts))
        if a.name != ref:
            out["cosine"][a.name] = check.cosines(ref_vecs, check.embeddings(urls[a.name], texts))
    return out


def run(args: argparse.Namespace, urls: dict[str, str] | None = None) -> dict:
    """The checks and the loads; `urls` ({arm name: URL}) runs against servers already up instead
    of starting the arms' own."""
    arms = arms_from(args)
    llama_names = [a.name for a in arms if a.llama]
    counts = {**DEFAULT_REQUESTS, **{k: v for k, v in (("template", args.template_requests),
                                                     ("documents", args.documents_requests),
                                                     ("query", args.query_requests)) if v is not None}}
    dataset = datasets.synthetic(args.queries, seed=args.seed)
    plans = {ld: load_requests(ld, dataset, items=args.items, count=args.warmup + counts[ld]) for ld in args.loads}
    doc: dict = {"command": shlex.join([sys.executable, "-m", "benchmarks.llama_cpp_peer", *sys.argv[1:]]),
                 "machine": machine.current(), "items": args.items, "arms": {a.name: list(a.argv) for a in arms},
                 "loads": {}}
    with contextlib.ExitStack() as stack:
        if urls is None:
            urls = start(stack, arms, model_dir=args.model_dir, server_cmd=args.server_cmd,
                         log_dir=Path(args.log_dir), startup_timeout=args.startup_timeout)
        doc["checks"] = run_checks(urls, arms, check_texts(dataset))
        print(checks_text(doc["checks"]), flush=True)
        doc["uptime_before"] = uptime()
        for ld, reqs in plans.items():
            cfg = client.RunConfig(url=urls[arms[0].name], concurrency=1, requests=counts[ld], warmup=args.warmup,
                                   timeout=args.timeout, progress=False, warmup_continues=True)
            results = alternate.run(reqs, cfg, [urls[a.name] for a in arms])
            summaries = [report.summarize(r, name=a.name) for a, r in zip(arms, results)]
            for s in summaries:
                s.pop("latencies_ms", None)
            rows = ratio_rows(summaries, llama_names)
            doc["loads"][ld] = {"requests": counts[ld], "items_per_request": reqs[0].items, "rows": rows}
            print(f"\n### {ld}: {counts[ld]} requests of {reqs[0].items} items, alternating\n")
            print(markdown_table(rows, llama_names), flush=True)
        doc["uptime_after"] = uptime()
    doc["machine"] = machine.finish(doc["machine"])
    print(f"\nbefore: {doc['uptime_before']}\nafter:  {doc['uptime_after']}\nmachine: {machine.line(doc['machine'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def checks_text(checks: dict) -> str:
    """The checks in a few lines: token ids equal per llama arm, cosines per arm."""
    lines = [f"checks on {checks['texts']} texts, cosines against {checks['reference']}:"]
    for name, t in checks["tokens"].items():
        lines.append(f"  {name}: token ids equal on {t['equal']}/{t['texts']} texts"
                     + (f"; first mismatch {t['first_mismatch']}" if t["first_mismatch"] else ""))
    for name, c in checks["cosine"].items():
        lines.append(f"  {name}: cosine min {c['min']:.6f}, mean {c['mean']:.6f} (1 - min: {1 - c['min']:.1e})")
    return "\n".join(lines)


def default_llama_server() -> str | None:
    return os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama_cpp_peer", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="the checkpoint radixserve serves (the GGUFs' source)")
    p.add_argument("--gguf", action="append", required=True, metavar="NAME=PATH",
                   help="a llama-server arm `llama-NAME` serving PATH (repeat: f32=..., q8_0=...)")
    p.add_argument("--llama-server", default=default_llama_server(),
                   help="the llama-server binary (default: $LLAMA_SERVER, else llama-server on PATH)")
    p.add_argument("--ours", action="append", metavar="NAME=FLAGS",
                   help="a radixserve arm with FLAGS (repeat; the first is the fp32 reference; default: "
                        + ", ".join(repr(s) for s in DEFAULT_OURS) + ")")
    p.add_argument("--server-cmd", help="the command that starts radixserve (default: radixserve on PATH)")
    p.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS))
    p.add_argument("--items", type=int, default=8, help="items per request of template and documents (a 64-item "
                   "request of the 28-layer model takes llama.cpp minutes on 2 cores)")
    p.add_argument("--template-requests", type=int, help=f"measured rounds (default {DEFAULT_REQUESTS['template']})")
    p.add_argument("--documents-requests", type=int, help=f"(default {DEFAULT_REQUESTS['documents']})")
    p.add_argument("--query-requests", type=int, help=f"(default {DEFAULT_REQUESTS['query']})")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds per load (never repeated)")
    p.add_argument("--queries", type=int, default=200, help="synthetic dataset size (queries)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    p.add_argument("--parallel", type=int, default=8, help="llama-server -np (slots batched together)")
    p.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server context per slot (-c = np x this)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default="out/llama-cpp-peer")
    p.add_argument("--json", help="write every figure here")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if not args.llama_server:
        p.error("no llama-server: pass --llama-server or set LLAMA_SERVER (docs/performance/cpu.md, "
                "'Against llama.cpp', builds one)")
    for name in ("items", "parallel", "ctx_per_slot", "threads", "queries"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("template_requests", "documents_requests", "query_requests"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    try:
        arms_from(args)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()

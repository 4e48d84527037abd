"""`radixserve-loadtest`: run | compare | dataset | soak.

  radixserve-loadtest run --url http://127.0.0.1:8080 --workload rerank --concurrency 8 --out out/
  radixserve-loadtest compare --model-id DIR --workload embed-template \\
      --server "off: --radix-mlp-threshold 0" --server "compact: --radix-mlp-threshold 1" --baseline
  radixserve-loadtest compare --model-id DIR --workload rerank --batch-size 4 --order interleave:8 \
      --concurrency 8 --server "fifo: --batching-policy fifo" --server "prefix: --batching-policy prefix"
  radixserve-loadtest compare --model-id DIR --workload embed-chunks --concurrency 1 --ports 8000-8010 \
      --server "cache-off: --prefix-cache-size 0" --server "cache-on@8020: "
  radixserve-loadtest dataset --source synthetic --query-words 80,160 --out long-queries.jsonl
  radixserve-loadtest soak --target http://127.0.0.1:8080 --duration 600 --pid PID --out out/soak

Every report names its data source; synthetic data is labelled "synthetic" wherever it appears.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from loadtest import datasets, documents, machine, needs, report, workloads
from loadtest.client import RunConfig, TargetDown


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def _number(kind: type, *, low: float, strict: bool):
    """An argparse type: ``kind`` (int or float) that is finite and > low (strict) or >= low."""
    want = f"{'an integer' if kind is int else 'a number'} {'>' if strict else '>='} {low:g}"

    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"want {want}, got {text!r}") from None
        if not (x > low if strict else x >= low) or x == float("inf"):
            raise argparse.ArgumentTypeError(f"want {want}, got {text!r}")
        return x

    return parse


_positive_int = _number(int, low=1, strict=False)
_non_negative_int = _number(int, low=0, strict=False)
_positive_float = _number(float, low=0.0, strict=True)


def _word_range(text: str) -> tuple[int, int]:
    """`MIN,MAX` (or a single N for MIN = MAX = N) with 1 <= MIN <= MAX."""
    parts = text.split(",")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        lo, hi = 0, 0
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want MIN,MAX integers with 1 <= MIN <= MAX, got {text!r}")
    return (lo, hi)


def _ports(text: str) -> tuple[int, int]:
    from loadtest import compare

    try:
        return compare.parse_ports(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _order(text: str) -> workloads.Order:
    try:
        return workloads.parse_order(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--source", choices=datasets.SOURCES, default="auto",
                   help="auto: --dataset-path if given, else MS MARCO from the hub, else synthetic")
    g.add_argument("--dataset-path", default=None, help="local MS MARCO .jsonl/.json/.parquet")
    g.add_argument("--split", default="validation", help="MS MARCO split (hub source)")
    g.add_argument("--queries", type=_positive_int, default=200, help="queries to read or generate")
    g.add_argument("--seed", type=int, default=0, help="synthetic generator seed (and --order shuffled's)")
    g.add_argument("--query-words", type=_word_range, default=datasets.QUERY_WORDS, metavar="MIN,MAX",
                   help="synthetic: topic words per query after the opener (default {},{})".format(*datasets.QUERY_WORDS))
    g.add_argument("--passage-words", type=_word_range, default=datasets.PASSAGE_WORDS, metavar="MIN,MAX",
                   help="synthetic: words per passage (default {},{})".format(*datasets.PASSAGE_WORDS))


def _add_load_args(p: argparse.ArgumentParser) -> None:
    _add_data_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--workload", choices=workloads.WORKLOADS, default="rerank")
    g.add_argument("--batch-size", type=_positive_int, default=None,
                   help=f"items per request (default: {workloads.EMBED_BATCH_SIZE} for /v1/embeddings; "
                        "and /classify; rerank and reward-best-of-n: all passages of a query in one request)")
    g.add_argument("--order", type=_order, default=workloads.Order(), metavar="grouped|shuffled|interleave:K",
                   help="request order: grouped (dataset order, default), shuffled (seeded by --seed), or "
                        "interleave:K (K users, each one query at a time, merged round-robin)")
    g.add_argument("--doc-words", type=_word_range, default=documents.DOC_WORDS, metavar="MIN,MAX",
                   help="embed-chunks: words per document (default {},{})".format(*documents.DOC_WORDS))
    g.add_argument("--chunk-words", type=_word_range, default=documents.CHUNK_WORDS, metavar="MIN,MAX",
                   help="embed-chunks: words per chunk (default {},{})".format(*documents.CHUNK_WORDS))
    g.add_argument("--instruction", default=workloads.DEFAULT_INSTRUCTION)
    g.add_argument("--model", default=None, help="'model' field of /v1/embeddings bodies")
    g.add_argument("--encoding-format", choices=workloads.ENCODINGS, default="float",
                   help="/v1/embeddings answers as float JSON or base64 (a quarter of the bytes: keeps the "
                        "client from being the bottleneck against a fast server)")
    g.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight")
    g.add_argument("--requests", type=_positive_int, default=None,
                   help="requests to send (default: one pass over the data when --duration is unset)")
    g.add_argument("--duration", type=_positive_float, default=None, help="stop sending after this many seconds")
    g.add_argument("--warmup", type=_non_negative_int, default=2,
                   help="unmeasured requests first, one at a time: the workload's first ones with every query and "
                        "passage marked, so none is a measured request (a prefix cache cannot answer from them)")
    g.add_argument("--warmup-continues", action="store_true",
                   help="the measured run starts after the first --warmup requests of the list "
                        "(default: at the first request)")
    g.add_argument("--timeout", type=_positive_float, default=120.0, help="per-request timeout (s)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true",
                   help="no progress line (it is drawn only when stderr is a terminal anyway)")
    g.add_argument("--title", default=None,
                   help="report and plot title (the plot adds the data source to it)")
    g.add_argument("--out", default=None, help="directory for report.json, report.md and report.png")
    g.add_argument("--no-plot", action="store_true",
                   help="with --out: no report.png (for a machine without matplotlib)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("radixserve-loadtest", description="Load tests for radixserve (MS MARCO replay).")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="load one running server")
    r.add_argument("--url", required=True, help="explicit server URL, e.g. http://127.0.0.1:8080")
    r.add_argument("--name", default=None, help="label in the report (default: the URL)")
    _add_load_args(r)

    c = sub.add_parser("compare", help="same workload against several targets, one after another")
    c.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                   help="a running server; NAME=ROUTER_URL@URL,URL,... a router whose replicas' /metrics add up")
    c.add_argument("--server", action="append", default=[], metavar="'NAME: FLAGS'",
                   help="start radixserve with FLAGS ('NAME:@baseline' starts the transformers peer)")
    c.add_argument("--baseline", action="store_true", help="add the transformers peer as target 'baseline'")
    c.add_argument("--model-id", default=None, help="checkpoint directory for started servers")
    c.add_argument("--server-cmd", default=None, help="radixserve command (default: radixserve or python -m server.cli)")
    c.add_argument("--startup-timeout", type=_positive_float, default=300.0, help="seconds to wait for /health")
    c.add_argument("--ports", type=_ports, default=None, metavar="PORT|LO-HI",
                   help="loopback ports for started servers without their own NAME@PORTS (default: any free)")
    c.add_argument("--alternate", action="store_true",
                   help="with --concurrency 1: start every server first, then send each request to every target "
                        "in turn (a noisy machine's slow spells hit all targets alike)")
    _add_load_args(c)

    d = sub.add_parser("dataset", help="write the chosen data set as MS MARCO-schema JSONL")
    _add_data_args(d)
    d.add_argument("--out", required=True, help="output .jsonl")

    s = sub.add_parser("soak", help="valid and hostile requests against a local server; RSS, fds, codes, drift")
    s.add_argument("--target", required=True, help="loopback server URL, e.g. http://127.0.0.1:8080")
    s.add_argument("--duration", type=_positive_float, required=True, help="seconds to run")
    s.add_argument("--concurrency", type=_positive_int, default=4, help="workers")
    s.add_argument("--interval", type=_positive_float, default=5.0, help="seconds between samples")
    s.add_argument("--pid", type=_positive_int, default=None, help="server process id (RSS and fds from /proc)")
    s.add_argument("--max-requests", type=_positive_int, default=100_000, help="stop after this many requests")
    s.add_argument("--churn", action="store_true",
                   help="valid requests carry inputs that differ in content, count and length (seeded)")
    s.add_argument("--out", required=True, help="output directory (soak.json, soak.md)")
    return p


def _dataset(a) -> datasets.Dataset:
    ds = datasets.load(a.source, path=a.dataset_path, split=a.split, limit=a.queries, seed=a.seed,
                       query_words=a.query_words, passage_words=a.passage_words, warn=_warn)
    shaped = (a.query_words, a.passage_words) != (datasets.QUERY_WORDS, datasets.PASSAGE_WORDS)
    if shaped and not ds.synthetic:
        _warn(f"--query-words/--passage-words shape synthetic data only; ignored for {ds.source}")
    return ds


def _load(a) -> tuple[datasets.Dataset, list[workloads.Request]]:
    ds = _dataset(a)
    reqs = _requests(a, ds)
    n_items = sum(r.items for r in reqs)
    print(f"data: {ds.source}, {len(ds.samples)} queries, {len(reqs)} {a.workload} requests "
          f"({_order_label(a)}), {n_items} items", file=sys.stderr)
    return ds, reqs


def _requests(a, ds: datasets.Dataset) -> list[workloads.Request]:
    return workloads.build_requests(ds, a.workload, batch_size=a.batch_size, instruction=a.instruction,
                                    model=a.model, order=a.order, seed=a.seed, chunking=_chunking(a),
                                    encoding=a.encoding_format)


def _warmups(a, ds: datasets.Dataset) -> tuple[workloads.Request, ...]:
    """The warm-up's requests: the workload built from the marked data set (workloads.warmup_dataset)."""
    pool = _requests(a, workloads.warmup_dataset(ds))[: a.warmup] if a.warmup else []
    return tuple(pool[i % len(pool)] for i in range(a.warmup)) if pool else ()


def _chunking(a) -> documents.Chunking:
    return documents.Chunking(doc_words=a.doc_words, chunk_words=a.chunk_words)


def _run_config(a, url: str, ds: datasets.Dataset) -> RunConfig:
    return RunConfig(url=url, concurrency=a.concurrency, requests=a.requests, duration=a.duration,
                     warmup=a.warmup, timeout=a.timeout, progress=not a.quiet, api_key=a.api_key,
                     warmup_continues=a.warmup_continues, warmup_requests=_warmups(a, ds))


def _order_label(a) -> str:
    """`grouped`, `shuffled(seed=S)` or `interleave:K` (what the report records)."""
    return f"shuffled(seed={a.seed})" if a.order.mode == "shuffled" else str(a.order)


def _meta(a, ds: datasets.Dataset, **extra) -> dict:
    """The workload section of a report. batch_size is the effective one: None for rerank's
    default (all passages of a query per request), 1 for the one-item workloads."""
    if a.workload in workloads.ONE_ITEM:
        batch = 1
    else:
        batch = a.batch_size if a.workload in ("rerank", "reward-best-of-n") else (a.batch_size or workloads.EMBED_BATCH_SIZE)
    shape = {"chunking": _chunking(a).label()} if a.workload == "embed-chunks" else {}
    return {"workload": a.workload, "source": ds.source, "order": _order_label(a), "concurrency": a.concurrency,
            "batch_size": batch, **shape, "requests": a.requests, "duration": a.duration, **extra}


def _emit(summaries: list[dict], a, *, title: str) -> None:
    title = a.title or title
    print(report.markdown(summaries, title=title))
    if a.out:
        from loadtest import plot

        paths = report.write(summaries, a.out, title=title)
        written = [paths["json"], paths["md"]]
        if not a.no_plot:
            written.append(plot.plot(summaries, Path(a.out) / "report.png", title=title))
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)


def cmd_run(a) -> int:
    from loadtest import client

    client.probe(a.url)  # a dead URL fails here, not as a run of connection errors
    ds, reqs = _load(a)
    host = machine.current()
    res = client.run(reqs, _run_config(a, a.url, ds))
    s = report.summarize(res, name=a.name or a.url, meta=_meta(a, ds, url=a.url, machine=machine.finish(host)))
    for line in report.repeat_warnings([s]):
        _warn(line)
    _emit([s], a, title=f"radixserve load test: {a.workload}")
    return 0 if res.ok else 1


def cmd_compare(a) -> int:
    from loadtest import client, compare

    targets = [compare.parse_target(t) for t in a.target] + [compare.parse_server(s) for s in a.server]
    if a.baseline:
        targets.append(compare.Target(name="baseline", baseline=True))
    if not targets:
        raise SystemExit("compare: give at least one --target, --server or --baseline")
    for t in targets:  # running targets must answer before any server is started
        if not t.managed:
            client.probe(t.url)
    ds, reqs = _load(a)
    log_dir = Path(a.out) if a.out else Path(".")
    host = machine.current()
    results = compare.run_targets(
        targets, reqs, _run_config(a, "http://127.0.0.1", ds), model_id=a.model_id, server_cmd=a.server_cmd,
        log_dir=log_dir, startup_timeout=a.startup_timeout, ports=a.ports, alternate=a.alternate,
    )
    runs = {"machine": machine.finish(host), **({"alternate": True} if a.alternate else {})}
    summaries = [
        report.summarize(res, name=t.name, meta=_meta(a, ds, **runs, target=t.url or " ".join(
            (["@baseline"] if t.baseline else []) + list(t.flags))))
        for t, res in results
    ]
    for line in report.repeat_warnings(summaries):
        _warn(line)
    _emit(summaries, a, title=f"radixserve compare: {a.workload}")
    return 0 if all(res.ok for _, res in results) else 1


def cmd_dataset(a) -> int:
    ds = _dataset(a)
    path = datasets.write_jsonl(ds, a.out)
    print(f"wrote {len(ds.samples)} queries from {ds.source} to {path}", file=sys.stderr)
    return 0


def cmd_soak(a) -> int:
    import asyncio

    from loadtest import soak

    config = soak.SoakConfig(url=a.target, duration_s=a.duration, concurrency=a.concurrency,
                             interval_s=a.interval, pid=a.pid, max_requests=a.max_requests, churn=a.churn)
    result = asyncio.run(soak.soak(config))
    js, md = soak.write(result, a.out)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0 if result.ok else 1


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    gone = needs.missing(a)  # before any server starts or request goes out
    if gone:
        print(needs.message(gone), file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so servers started by `compare` are stopped on the way out.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main else None
    try:
        return {"run": cmd_run, "compare": cmd_compare, "dataset": cmd_dataset, "soak": cmd_soak}[a.cmd](a)
    except (datasets.DatasetError, ValueError, TargetDown) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())

"""Prefix cache benchmark through the runner (prepare + run): cache on vs cache off vs radix off.

Every batch of a workload runs once under each configuration, the three taking turns (the order
rotates per batch) so background load hits them alike; the cache sees each batch once, so hits
come only from what earlier batches share with it, as in serving. Configurations:
- `cache`:    the trie gated at --threshold, the prefix cache on (one preallocated pool);
- `no-cache`: the same trie and gate, no cache;
- `radix-off`: neither (mode "off").
Workloads (synthetic MS MARCO-shaped text from loadtest.datasets, the real Qwen3 templates):
- `rerank-1`: pointwise reranking, one query-document pair per batch (Qwen3-Reranker template);
- `rerank-4`: four pairs of one query per batch;
- `query`:    query embeddings with the Qwen3-Embedding instruction, one per batch;
- `embed-template`: the paper's workload, pairs rendered in the reranker template and embedded,
              64 per batch (full batches: the cache must cost nothing here);
- `chunks`:   chunk embeddings of a long document, one chunk per batch with the whole document
              as context prefix.
Prints per workload and configuration: batches, tokens per batch, computed rows per batch, p50 ms
per batch, throughput, and the ratios against `no-cache`. Figures only; nothing is asserted.

    python -m benchmarks.bench_cache --preset qwen3-0.6b --layers 2 --dtype float32

`--host` measures the cache's bookkeeping alone instead (benchmarks/bench_cache_host.py): the
CPU-seconds per 1M tokens of `PrefixCache.plan` and `commit` under eviction pressure, and the
worker's host time per batch in `runner.run` with a zero-cost forward, on the embed-template load
(64 templated pairs per batch) and a rerank load (one query, 100 passages per batch):

    python -m benchmarks.bench_cache --host
"""
from __future__ import annotations

import dataclasses

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.cache_workloads import KIND, WORKLOADS, workload_batches
from models.runner import Runner, load_runner


CONFIGS = ("cache", "no-cache", "radix-off")


@dataclass(frozen=True)
class Result:
    workload: str
    config: str
    batches: int
    tokens: float  # per batch
    rows: float  # computed rows per batch
    p50_ms: float
    tokens_per_s: float


def _prepare(runner: Runner, seqs, config: str, cache, threshold: float):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    # The runner builds and gates the trie itself: radix off is threshold 0 (never built).
    gated = dataclasses.replace(runner, radix_mlp_threshold=0.0 if config == "radix-off" else threshold,
                                prefix_cache=cache if config == "cache" else None)
    return gated.prepare(ids, cu)


def bench(runner: Runner, batches, *, workload: str, threshold: float = 0.95,
          warmup: int = 1) -> list[Result]:
    """Each batch under each configuration in turn; the cache state carries across batches."""
    cache = runner.prefix_cache
    if cache is None:
        raise ValueError("the runner has no prefix cache (size 0, or a mode it cannot serve)")
    cuda = runner.device.type == "cuda"
    ms: dict[str, list[float]] = {c: [] for c in CONFIGS}
    rows: dict[str, list[int]] = {c: [] for c in CONFIGS}
    for k, seqs in enumerate(batches):
        order = CONFIGS[k % 3:] + CONFIGS[:k % 3]
        for config in order:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fb = _prepare(runner, seqs, config, cache, threshold)
            runner.run(fb)  # commits the batch's new blocks into the pool (cache config)
            if cuda:
                torch.cuda.synchronize()
            if k >= warmup:
                ms[config].append((time.perf_counter() - t0) * 1e3)
                rows[config].append(fb.n_compact)
    tokens = [sum(len(s) for s in seqs) for seqs in batches[warmup:]]
    out = []
    for config in CONFIGS:
        out.append(Result(workload=workload, config=config, batches=len(tokens),
                          tokens=float(np.mean(tokens)), rows=float(np.mean(rows[config])),
                          p50_ms=statistics.median(ms[config]),
                          tokens_per_s=sum(tokens) / (sum(ms[config]) / 1e3)))
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-0.6b", help="fixture preset (fixtures.PRESETS)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fixture-root", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--batches", type=int, default=30, help="batches per workload (embed-template: /4)")
    p.add_argument("--threshold", type=float, default=0.95, help="the trie gate (--radix-mlp-threshold)")
    p.add_argument("--prefix-cache-size", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", action="store_true",
                   help="the cache's bookkeeping alone: plan/commit CPU time, worker host time")
    p.add_argument("--host-batches", type=int, default=12, help="--host: batches per load")
    p.add_argument("--host-block", type=int, nargs="+", default=[16], metavar="TOKENS",
                   help="--host: block sizes for plan/commit alone (the server uses 16)")
    p.add_argument("--host-repeat-capacity", type=int, default=65536, metavar="TOKENS",
                   help="--host-block: the pool the load goes through twice (hits against block size)")
    p.add_argument("--host-capacity", type=int, default=24576,
                   help="--host: pool tokens (below a few batches' worth: eviction under pressure)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import fixtures

    if args.host:
        from benchmarks.bench_cache_host import host_main

        return host_main(args)

    runners: dict[str, Runner] = {}
    print(f"# {args.preset} layers={args.layers}, {torch.get_num_threads()} threads, "
          f"threshold {args.threshold}, prefix cache {args.prefix_cache_size}; p50 per batch, "
          f"x = against no-cache (time ratio: lower is better; throughput ratio: higher)")
    print(f"{'workload':>15} {'config':>9} {'batches':>7} {'tok/b':>7} {'rows/b':>7} {'p50 ms':>8} "
          f"{'tok/s':>8} {'p50 x':>6} {'tput x':>6}")
    for name in args.workloads:
        kind = KIND[name]
        if kind not in runners:
            path = fixtures.cached(args.preset, layers=args.layers, kind=kind, root=args.fixture_root)
            runners[kind] = load_runner(str(path), device=args.device, dtype=args.dtype,
                                        prefix_cache_size=args.prefix_cache_size)
        runner = runners[kind]
        n = max(2, args.batches // 4) if name == "embed-template" else args.batches
        results = bench(runner, workload_batches(name, runner, n=n + 1, seed=args.seed),
                        workload=name, threshold=args.threshold)
        base = next(r for r in results if r.config == "no-cache")
        for r in results:
            print(f"{r.workload:>15} {r.config:>9} {r.batches:>7} {r.tokens:>7.0f} {r.rows:>7.0f} "
                  f"{r.p50_ms:>8.1f} {r.tokens_per_s:>8.0f} {r.p50_ms / base.p50_ms:>6.2f} "
                  f"{r.tokens_per_s / base.tokens_per_s:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""OpenMP wait policies side by side: the forward's median time in fresh processes, one per policy.

    python -m benchmarks.bench_openmp --rounds 2 [--hogs 2] [--policies default passive spin10k]

Each round starts one process per policy (the runtime reads its wait policy once, when torch is
imported), in alternating order, and times ``runner.run`` in process on three shapes: the tiny
test fixture with one 22-token input, and the 2-layer Qwen3-0.6B-shaped fixture with 1 and 16
inputs. ``--hogs N`` keeps N busy-looping processes running meanwhile (a host whose cores other
work wants). Prints one JSON line per process: median milliseconds per shape. These forwards run
on each process's main thread, unlike the server's; docs/decisions.md ("OpenMP's wait policy
left alone") has the server-level comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin10k": {"GOMP_SPINCOUNT": "10000"},
            "spin30k": {"GOMP_SPINCOUNT": "30000"}, "spin100k": {"GOMP_SPINCOUNT": "100000"}}
SHAPES = (("tiny-embedding", 1, 150), ("qwen3-0.6b", 1, 20), ("qwen3-0.6b", 16, 6))  # preset, inputs, reps

CHILD = r'''
import json, statistics, sys, time
import numpy as np
import models
import fixtures
out = {}
for preset, n_in, reps in json.loads(sys.argv[1]):
    path = fixtures.cached(preset, layers=None if preset == "tiny-embedding" else 2, kind="embedding")
    r = models.load_runner(str(path), device="cpu", dtype="float32", radix_mlp_threshold=0.95,
                           prefix_cache_size="0", keep_dense_weights=False)
    text = "Instruct: Given a web search query, retrieve relevant passages\nQuery: what is the capital of france"
    seqs = [r.tokenizer.encode(text + f" {i} words " * (i % 5)).ids for i in range(n_in)]
    ids = np.array([t for s in seqs for t in s], dtype=np.int32)
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    r.run(r.prepare(ids, cu))
    times = []
    for _ in range(reps):
        p = r.prepare(ids, cu)
        t0 = time.perf_counter()
        r.run(p)
        times.append(time.perf_counter() - t0)
    out[f"{preset} x{n_in} ({len(ids)} tokens)"] = round(statistics.median(times) * 1e3, 3)
print(json.dumps(out))
'''


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hogs", type=int, default=0, help="busy-looping processes running meanwhile")
    p.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=list(POLICIES))
    a = p.parse_args(argv)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    order = list(a.policies)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hogs)]
    try:
        _rounds(a.rounds, order, base)
    finally:
        for h in hogs:
            h.kill()
    return 0


def _rounds(rounds: int, order: list[str], base: dict) -> None:
    for i in range(rounds):
        for name in order if i % 2 == 0 else order[::-1]:
            proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SHAPES)], capture_output=True, text=True,
                                  env={**base, **POLICIES[name]}, check=True)
            print(json.dumps({"round": i, "policy": name, "median_ms": json.loads(proc.stdout.splitlines()[-1])}),
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark of the trie index builder (models.trie.build_index) on synthetic batches.

Each case is B sequences of L tokens whose first round(share * L) tokens are one common prefix
(share 0: all distinct, 1.0: all identical), plus the many-children case: 65,536 two-token
sequences sharing their first token. Figures are medians over --repeats builds; nothing here
asserts a time.

    python -m benchmarks.bench_index [--repeats N] [--json] [--seed S]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from models.trie import build_index, positions_from_cu_seqlens

_VOCAB = 151_669
_CASES = ((32, 512, 0.0), (32, 512, 0.25), (32, 512, 0.5), (32, 512, 1.0), (2048, 512, 0.25))
_BRANCHES = 65_536


@dataclass(frozen=True)
class Result:
    name: str
    tokens: int
    compact_tokens: int
    median_ms: float  # wall clock
    tokens_per_s: float  # from the wall-clock median
    median_cpu_ms: float  # process CPU time: steadier than wall clock on a shared machine


def shared_prefix_batch(batch: int, length: int, share: float, *, seed: int = 0):
    """(input_ids, position_ids, cu_seqlens) for B sequences sharing a prefix of share * L."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, _VOCAB, size=(batch, length))  # [B, L]
    ids[:, : int(round(share * length))] = ids[0, : int(round(share * length))]
    cu = np.arange(0, batch * length + 1, length)
    return ids.ravel(), positions_from_cu_seqlens(cu), cu


def branch_batch(branches: int = _BRANCHES):
    """B two-token sequences: one shared first token, B distinct second tokens."""
    ids = np.stack([np.full(branches, 7), np.arange(branches)], axis=1).ravel()  # [B*2]
    cu = np.arange(0, 2 * branches + 1, 2)
    return ids, positions_from_cu_seqlens(cu), cu


def measure(name: str, batch, *, repeats: int) -> Result:
    ids, pos, cu = batch
    index = build_index(ids, pos, cu)  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        build_index(ids, pos, cu)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    median = statistics.median(wall)
    return Result(
        name,
        tokens=int(ids.size),
        compact_tokens=int(index.compact_ids.size),
        median_ms=median * 1e3,
        tokens_per_s=ids.size / median,
        median_cpu_ms=statistics.median(cpu) * 1e3,
    )


def run(*, repeats: int, seed: int = 0) -> list[Result]:
    results = [
        measure(f"{b}x{length} shared={share:g}", shared_prefix_batch(b, length, share, seed=seed),
                repeats=repeats)
        for b, length, share in _CASES
    ]
    results.append(measure(f"{_BRANCHES} branches x2", branch_batch(), repeats=repeats))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench index", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed builds per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    results = run(repeats=args.repeats, seed=args.seed)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return 0
    print(f"{'case':<26} {'tokens':>9} {'compact':>9} {'median ms':>10} {'Mtok/s':>8} "
          f"{'cpu ms':>8}")
    for r in results:
        print(f"{r.name:<26} {r.tokens:>9} {r.compact_tokens:>9} {r.median_ms:>10.3f} "
              f"{r.tokens_per_s / 1e6:>8.2f} {r.median_cpu_ms:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

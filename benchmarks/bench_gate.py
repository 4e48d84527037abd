"""Where the prefix trie pays: a whole batch (``Runner.prepare`` + ``Runner.run``) with the trie
forced on (threshold 1) against without it (threshold 0, the trie not even built), per batch shape.

The trie's cost is the host work of building it and laying the batch out (the K/V gather index,
cu_seqlens_k) plus a K/V gather per layer; what it saves is the position-wise work (QKV, O, MLP)
of the rows it removes, which scales with saved rows x hidden size (x layers, like the gathers).
Each row prints N, N', saved rows, the hidden size, saved x hidden, both times and the speedup
of the trie; the gate's rule (models.options.use_index) is read off these figures.
Invariant: the two runners share one model and alternate call by call, so a shared machine's load
hits both alike; the prefix cache is off (its hits would differ between repeats). Figures only.

    python -m benchmarks.bench gate --preset tiny-reranker
    python -m benchmarks.bench gate --preset qwen3-0.6b --layers 2 --batch 4 16 --prefix 16 64 --suffix 16
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from benchmarks.synthetic import synthetic_batch
from models.runner import Runner, load_runner


def time_pair(runner: Runner, ids, cu, *, warmup: int, repeats: int) -> tuple[float, float, int]:
    """Fastest ms of prepare + run without and with the trie, and N' with it. NOTE: the minimum,
    not the median: on a loaded machine the median measures the other processes."""
    off = dataclasses.replace(runner, radix_mlp_threshold=0.0)
    on = dataclasses.replace(runner, radix_mlp_threshold=1.0)
    times: dict[str, list[float]] = {"off": [], "on": []}
    compact = 0
    with torch.inference_mode():
        for k in range(warmup + repeats):
            for name, r in (("off", off), ("on", on)) if k % 2 else (("on", on), ("off", off)):
                t0 = time.perf_counter()
                prepared = r.prepare(ids, cu)
                r.run(prepared)
                if r.device.type == "cuda":
                    torch.cuda.synchronize()
                if k >= warmup:
                    times[name].append((time.perf_counter() - t0) * 1e3)
                if name == "on":
                    compact = prepared.n_compact
    return min(times["off"]), min(times["on"]), compact


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench gate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-reranker", help="fixture preset (fixtures.PRESETS)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--kind", default=None, help="embedding or reranker (default: the preset's)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--batch", "-B", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--prefix", "-P", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--suffix", "-S", type=int, nargs="+", default=[16])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import fixtures

    model_dir = fixtures.cached(args.preset, layers=args.layers, kind=args.kind)
    runner = load_runner(str(model_dir), device=args.device, dtype=args.dtype, prefix_cache_size="0")
    hidden = runner.hidden_size
    print(f"{args.preset} layers={runner.config.num_hidden_layers} hidden={hidden} kind={runner.kind}")
    print(f"{'B':>4} {'P':>5} {'S':>4} {'N':>6} {'Nc':>6} {'saved':>6} {'saved*H':>9} "
          f"{'off_ms':>8} {'trie_ms':>8} {'speedup':>7}")
    for batch in args.batch:
        for prefix in args.prefix:
            for suffix in args.suffix:
                ids, cu = synthetic_batch(batch, prefix, suffix, vocab=runner.config.vocab_size, seed=0)
                n = int(cu[-1])
                off_ms, on_ms, compact = time_pair(runner, ids, cu, warmup=args.warmup, repeats=args.repeats)
                saved = n - compact
                print(f"{batch:>4} {prefix:>5} {suffix:>4} {n:>6} {compact:>6} {saved:>6} {saved * hidden:>9} "
                      f"{off_ms:>8.2f} {on_ms:>8.2f} {off_ms / on_ms:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

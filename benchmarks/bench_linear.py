"""CPU forward time with oneDNN-packed linears vs F.linear, alternating call by call.

    python -m benchmarks.bench_linear --preset qwen3-0.6b --layers 2 --rows 1 6 26 137 512 2048

One runner, one process: each round runs the same single-sequence batch (radix off, no prefix
cache: every row is computed) with the weights packed, then with them unpacked, so a shared
machine's load hits both alike. Prints median ms per row count and their ratio (figures only;
the outputs of both paths are compared and the largest difference printed beside them).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from models.batch import build_forward_batch
from models.linear import pack_linears, unpack_linears
from models.runner import Runner, load_runner


def compare(runner: Runner, rows: list[int], *, repeats: int = 7, warmup: int = 1, seed: int = 0) -> list[dict]:
    """[{rows, packed_ms, plain_ms, plain_over_packed, max_abs_diff}] for one sequence of each length."""
    rng = np.random.default_rng(seed)
    out = []
    for n in rows:
        ids = rng.integers(0, runner.config.vocab_size, n).astype(np.int32)
        fb = build_forward_batch(ids, np.asarray([0, n], np.int32), None, mode="off")
        times: dict[str, list[float]] = {"packed": [], "plain": []}
        outputs = {}
        for k in range(warmup + repeats):
            for name in ("packed", "plain"):
                if name == "packed":
                    reason = pack_linears(runner.model, device=runner.device, dtype=runner.dtype)
                    if reason is not None:
                        raise SystemExit(f"cannot pack here: {reason}")
                else:
                    unpack_linears(runner.model)
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    outputs[name] = runner.forward(fb).float()
                    dt = (time.perf_counter() - t0) * 1e3
                if k >= warmup:
                    times[name].append(dt)
        packed, plain = statistics.median(times["packed"]), statistics.median(times["plain"])
        out.append({"rows": n, "packed_ms": packed, "plain_ms": plain, "plain_over_packed": plain / packed,
                    "max_abs_diff": (outputs["packed"] - outputs["plain"]).abs().max().item()})
    pack_linears(runner.model, device=runner.device, dtype=runner.dtype)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_linear", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", help="a checkpoint directory (default: the --preset fixture)")
    p.add_argument("--preset", default="qwen3-0.6b", help="fixture preset (models.fixtures)")
    p.add_argument("--layers", type=int, default=2, help="layers of the fixture preset")
    p.add_argument("--fixture-root", default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 6, 26, 137, 512, 2048])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        from models import fixtures

        model_dir = str(fixtures.cached(args.preset, layers=args.layers, root=args.fixture_root))
    runner = load_runner(model_dir, device="cpu", dtype="float32", prefix_cache_size=0)
    print(f"# packed (oneDNN) vs plain (F.linear) linears, {model_dir}, cpu float32, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}, alternating")
    print(f"{'rows':>6} {'packed_ms':>10} {'plain_ms':>9} {'plain/packed':>13} {'max|d|':>8}")
    for r in compare(runner, args.rows, repeats=args.repeats):
        print(f"{r['rows']:>6} {r['packed_ms']:>10.1f} {r['plain_ms']:>9.1f} {r['plain_over_packed']:>13.2f} "
              f"{r['max_abs_diff']:>8.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU forward time with oneDNN-packed linears vs F.linear, alternating call by call; and the
reduced-precision weights (--cpu-weights int8, bf16) against fp32: speed and accuracy.

    python -m benchmarks.bench_linear --preset qwen3-0.6b --layers 2 --rows 1 6 26 137 512 2048
    python -m benchmarks.bench_linear --preset qwen3-0.6b --layers 2 --weights int8 bf16 --rows 1 26 512 2048
    python -m benchmarks.bench_linear --preset qwen3-0.6b --layers 2 --threads 1 --profile

With --weights: each round runs the batch with every precision's kernel (chosen as the server
chooses it, models/linear/select.py) in turn; then the accuracy against fp32 of embeddings
(cosine, max |difference|) in modes off, paper and compact over 16 texts sharing a prefix, and
of rerank scores (max |difference|) on the reranker fixture of the same shape.

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

from loadtest import machine
from models.batch import build_forward_batch
from models.linear.packed import pack_linears, unpack_linears
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


def weights_speed(runner: Runner, weights: list[str], rows: list[int], *, repeats: int = 5,
                  seed: int = 0) -> list[dict]:
    """[{rows, fp32_ms, <w>_ms, fp32_over_<w>, fp32_over_<w>_wall}]: one sequence of each length,
    alternating precisions.

    Milliseconds of this process's CPU time (all its threads): at one thread steadier than wall
    time on a shared machine, which waits for other processes too; at several threads it counts
    OpenMP's spinning workers, so the wall-time ratio is given beside it."""
    from models.linear.select import choose_linears

    rng = np.random.default_rng(seed)
    names = ["fp32", *weights]
    picks = {}
    for w in names:  # measured once, as at load; then forced by name in the rounds
        picks[w] = choose_linears(runner.model, device=runner.device, dtype=runner.dtype, weights=w).kernel
    out = []
    for n in rows:
        ids = rng.integers(0, runner.config.vocab_size, n).astype(np.int32)
        fb = build_forward_batch(ids, np.asarray([0, n], np.int32), None, mode="off")
        times: dict[str, list[float]] = {w: [] for w in names}
        walls: dict[str, list[float]] = {w: [] for w in names}
        for k in range(1 + repeats):
            for w in names:
                choose_linears(runner.model, device=runner.device, dtype=runner.dtype, weights=w, force=picks[w])
                with torch.inference_mode():
                    t0, w0 = time.process_time(), time.perf_counter()
                    runner.forward(fb)
                    dt, dw = time.process_time() - t0, time.perf_counter() - w0
                if k:
                    times[w].append(dt * 1e3)
                    walls[w].append(dw)
        row: dict = {"rows": n}
        for w in names:
            row[f"{w}_ms"] = statistics.median(times[w])
            row[f"fp32_over_{w}"] = row["fp32_ms"] / row[f"{w}_ms"]
            row[f"fp32_over_{w}_wall"] = statistics.median(walls["fp32"]) / statistics.median(walls[w])
        out.append(row)
    choose_linears(runner.model, device=runner.device, dtype=runner.dtype, weights="fp32", force=picks["fp32"])
    return out


def accuracy(runner: Runner, weights: str, *, texts: int = 16, seed: int = 0) -> dict:
    """Embeddings (reranker: scores) with `weights` vs fp32 F.linear, in modes off, paper, compact."""
    import dataclasses

    from models.linear.select import choose_linears

    rng = np.random.default_rng(seed)
    vocab = runner.config.vocab_size
    prefix = rng.integers(0, vocab, 24)
    seqs = [np.concatenate([prefix, rng.integers(0, vocab, int(rng.integers(3, 60)))]) for _ in range(texts)]
    ids = np.concatenate(seqs).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)

    def run(mode: str) -> torch.Tensor:
        r = dataclasses.replace(runner, radix_attention="compact" if mode == "off" else mode,
                                radix_mlp_threshold=0.0 if mode == "off" else 1.0)
        return torch.as_tensor(r.run(r.prepare(ids, cu))).double()

    choose_linears(runner.model, device=runner.device, dtype=runner.dtype, weights="fp32", force="F.linear")
    want = run("off")
    choose_linears(runner.model, device=runner.device, dtype=runner.dtype, weights=weights)
    out: dict = {"weights": weights}
    for mode in ("off", "paper", "compact"):
        got = run(mode)
        out[f"{mode}_max_abs"] = (got - want).abs().max().item()
        if got.dim() == 2:
            out[f"{mode}_min_cos"] = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
    out["scale"] = want.abs().max().item()
    choose_linears(runner.model, device=runner.device, dtype=runner.dtype, weights="fp32")
    return out


def profile_off(runner: Runner, *, items: int = 32, prefix: int = 30, seed: int = 0, top: int = 8) -> list[tuple]:
    """[(op, self ms, share, calls)]: torch.profiler over one radix-off batch of `items` texts that
    share a `prefix`-token instruction (10-60 own tokens each), after one untimed run."""
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(seed)
    head = rng.integers(0, runner.config.vocab_size, prefix)
    seqs = [np.concatenate([head, rng.integers(0, runner.config.vocab_size, int(rng.integers(10, 60)))])
            for _ in range(items)]
    ids = np.concatenate(seqs).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    import dataclasses

    off = dataclasses.replace(runner, radix_mlp_threshold=0.0)  # no trie: every row computed
    off.run(off.prepare(ids, cu))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        off.run(off.prepare(ids, cu))
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [(e.key, e.self_cpu_time_total / 1e3, e.self_cpu_time_total / total, e.count) for e in events[:top]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_linear", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", help="a checkpoint directory (default: the --preset fixture)")
    p.add_argument("--preset", default="qwen3-0.6b", help="fixture preset (fixtures.PRESETS)")
    p.add_argument("--layers", type=int, default=2, help="layers of the fixture preset")
    p.add_argument("--fixture-root", default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 6, 26, 137, 512, 2048])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--profile", action="store_true",
                   help="profile one radix-off batch of 32 texts sharing an instruction: the top ops' share")
    p.add_argument("--weights", nargs="*", choices=("int8", "bf16"), default=None,
                   help="compare these --cpu-weights precisions against fp32 (speed and accuracy)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        import fixtures

        model_dir = str(fixtures.cached(args.preset, layers=args.layers, root=args.fixture_root))
    runner = load_runner(model_dir, device="cpu", dtype="float32", prefix_cache_size=0)
    print(f"# machine: {machine.line(machine.current())}")
    if args.weights:
        return _weights_main(runner, args, model_dir)
    if args.profile:
        print(f"# one radix-off batch, {model_dir}, {torch.get_num_threads()} threads, linears: {runner.report.linear}")
        for op, ms, share, calls in profile_off(runner):
            print(f"{op:55s} {ms:9.1f} ms {100 * share:5.1f}% {calls:5d} calls")
        return 0
    print(f"# packed (oneDNN) vs plain (F.linear) linears, {model_dir}, cpu float32, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}, alternating")
    print(f"{'rows':>6} {'packed_ms':>10} {'plain_ms':>9} {'plain/packed':>13} {'max|d|':>8}")
    for r in compare(runner, args.rows, repeats=args.repeats):
        print(f"{r['rows']:>6} {r['packed_ms']:>10.1f} {r['plain_ms']:>9.1f} {r['plain_over_packed']:>13.2f} "
              f"{r['max_abs_diff']:>8.1e}")
    return 0




def _weights_main(runner: Runner, args, model_dir: str) -> int:
    weights = list(args.weights)
    print(f"# fp32 vs {' '.join(weights)} weights, {model_dir}, cpu float32, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} (CPU ms of the process), alternating")
    rows = weights_speed(runner, weights, args.rows, repeats=args.repeats)
    print(" ".join([f"{'rows':>6}", f"{'fp32_ms':>9}"] + [f"{w + '_ms':>9} {'fp32/' + w:>10} {'wall':>6}"
                                                            for w in weights]))
    for r in rows:
        print(" ".join([f"{r['rows']:>6}", f"{r['fp32_ms']:>9.1f}"]
                       + [f"{r[w + '_ms']:>9.1f} {r['fp32_over_' + w]:>10.2f} {r['fp32_over_' + w + '_wall']:>6.2f}"
                          for w in weights]))
    reranker = None
    if args.model_dir is None:
        import fixtures

        rdir = fixtures.cached(args.preset, layers=args.layers, kind="reranker", root=args.fixture_root)
        reranker = load_runner(str(rdir), device="cpu", dtype="float32", prefix_cache_size=0)
    for w in weights:
        for name, r in (("embed", runner), ("rerank", reranker)):
            if r is None:
                continue
            a = accuracy(r, w)
            print(f"# {name} {w} vs fp32 (F.linear), |fp32| up to {a['scale']:.3g}: " + "; ".join(
                f"{m}: max|d| {a[m + '_max_abs']:.2e}" + (f", min cos {a[m + '_min_cos']:.6f}" if m + "_min_cos" in a else "")
                for m in ("off", "paper", "compact")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

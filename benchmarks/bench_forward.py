"""Forward benchmark: off / paper / compact on synthetic prefix-sharing batches.

Each batch is B sequences sharing one P-token prefix, each with its own S-token suffix (random
ids). For each mode it prints N, N', the ratio, the median forward time (modes interleaved round by round), the speedup over `off`
and the Amdahl prediction 1/((1-f) + f/r) with r = N/N' and f the position-wise share of the
`off` forward's FLOPs (computed analytically); `amdahl_t` uses f_t, the position-wise share of
the `off` forward's measured time instead. `idx_ms` is the host time of building the trie for
the batch: what the threshold gate spends (on the prep thread) even when it then runs `off`.
`--prefix 0` shares nothing, the case where radix on must cost no more than off.
`--ab OLD_ROOT` instead times this checkout's model against the model code of another checkout
(its family module models/families/qwen3.py and models/checkpoint/loader.py, or where that checkout
keeps them, models/qwen3.py and models/loader.py; same weights, same batches, same attention backend
and gathers) in one process, alternating old/new within each round, so machine load hits both
alike: the way to measure a model-code change on a shared, noisy machine.
`--count-ops` instead prints the operators one decoder layer dispatches per forward (torch
profiler, CPU): on a GPU each is at least one kernel launch, the cost that dominates small batches.
Figures only; nothing is asserted.

    python -m benchmarks.bench forward --preset qwen3-0.6b --layers 2 --dtype float32 \
        --batch 16 --prefix 128 512 --suffix 128
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from benchmarks.bench_forward_ab import ab, attention_ab, count_ops, old_model
from benchmarks.synthetic import MODES, synthetic_batch
from models.batch import build_forward_batch
from models.checkpoint.config import ModelConfig
from models.runner import Runner, load_runner
from models.trie import build_index, positions_from_cu_seqlens



@dataclass(frozen=True)
class Row:
    prefix: int
    mode: str
    tokens: int  # N
    compact_tokens: int  # N' (N for off)
    ratio: float  # N'/N
    median_ms: float
    speedup: float  # over off
    amdahl: float  # predicted speedup for the paper's method (f from FLOPs)
    pw_share: float  # f
    amdahl_time: float  # the same prediction with f measured as a share of `off` time
    pw_share_time: float
    index_ms: float  # median host time of build_index on this batch


def position_wise_share(cfg: ModelConfig, lens: list[int]) -> float:
    """f = position-wise FLOPs / all FLOPs of the `off` forward (per layer; layers cancel)."""
    e, h, hkv, d, i = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                       cfg.head_dim, cfg.intermediate_size)
    pw = 2 * (e * (h + 2 * hkv) * d + h * d * e + 3 * e * i) * sum(lens)
    attn = sum(2 * 2 * h * d * n * (n + 1) / 2 for n in lens)
    return pw / (pw + attn)


def measured_pw_share(runner: Runner, fb_off, *, repeats: int) -> float:
    """f measured: 1 - (time inside attention) / (time of the whole `off` forward).

    NOTE: on CPU attention runs at a lower FLOP rate than the GEMMs, so the FLOP share
    overstates the position-wise share of *time*; this is the share Amdahl's law really needs.
    """
    kernels = runner.model.layers[0].self_attn.ops  # one AttentionOps object shared by all layers
    inner, spent = kernels.attention, []
    cuda = runner.device.type == "cuda"

    def timed(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        spent.append(time.perf_counter() - t0)
        return out

    shares = []
    kernels.attention = timed
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                spent.clear()
                t0 = time.perf_counter()
                runner.forward(fb_off)
                if cuda:
                    torch.cuda.synchronize()
                shares.append(1.0 - sum(spent) / (time.perf_counter() - t0))
    finally:
        kernels.attention = inner
    return statistics.median(shares)


def index_build_ms(ids: np.ndarray, cu: np.ndarray, *, repeats: int) -> float:
    """Median wall ms of build_index (positions included), as the prep thread runs it."""
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        build_index(ids, positions_from_cu_seqlens(cu), cu)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _time_interleaved(runner: Runner, batches: dict, *, warmup: int, repeats: int) -> dict:
    """Median ms per mode; modes alternate within each round so background load hits all alike."""
    cuda = runner.device.type == "cuda"
    times: dict[str, list[float]] = {mode: [] for mode in batches}
    with torch.inference_mode():
        for k in range(warmup + repeats):
            for mode, fb in batches.items():
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.forward(fb)
                if cuda:
                    torch.cuda.synchronize()
                if k >= warmup:
                    times[mode].append((time.perf_counter() - t0) * 1e3)
    return {mode: statistics.median(ts) for mode, ts in times.items()}


def bench(runner: Runner, *, batch: int, prefixes: list[int], suffix: int, warmup: int,
          repeats: int, seed: int, modes=MODES) -> list[Row]:
    rows = []
    mean = runner.kind == "embedding" and runner.pooling == "mean"
    for prefix in prefixes:
        ids, cu = synthetic_batch(batch, prefix, suffix, vocab=runner.config.vocab_size, seed=seed)
        index = build_index(ids, positions_from_cu_seqlens(cu), cu)
        index_ms = index_build_ms(ids, cu, repeats=repeats)
        n = int(cu[-1])
        f = position_wise_share(runner.config, np.diff(cu).tolist())
        r = n / len(index.compact_ids)
        amdahl = 1.0 / ((1 - f) + f / r)
        batches = {mode: build_forward_batch(ids, cu, None if mode == "off" else index, mode=mode,
                                             device=runner.device, mean_pooling=mean)
                   for mode in modes}
        ms = _time_interleaved(runner, batches, warmup=warmup, repeats=repeats)
        f_t = measured_pw_share(runner, batches["off"], repeats=repeats) if "off" in batches else float("nan")
        amdahl_t = 1.0 / ((1 - f_t) + f_t / r)
        base = ms.get("off")
        for mode, fb in batches.items():
            rows.append(Row(prefix=prefix, mode=mode, tokens=n, compact_tokens=fb.num_rows,
                            ratio=fb.num_rows / n, median_ms=ms[mode],
                            speedup=(base / ms[mode]) if base else float("nan"),
                            amdahl=1.0 if mode == "off" else amdahl, pw_share=f,
                            amdahl_time=1.0 if mode == "off" else amdahl_t, pw_share_time=f_t,
                            index_ms=index_ms))
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench forward", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="a checkpoint directory (or hub id)")
    src.add_argument("--preset", default="qwen3-0.6b", help="fixture preset (fixtures.PRESETS)")
    p.add_argument("--layers", type=int, default=None, help="layers of the fixture preset")
    p.add_argument("--fixture-root", default=None, help="where fixtures are cached")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32, float16, bfloat16")
    p.add_argument("--batch", "-B", type=int, default=16)
    p.add_argument("--prefix", "-P", type=int, nargs="+", default=[128, 512])
    p.add_argument("--suffix", "-S", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--attention", default=None, choices=["sdpa", "sdpa-padded"],
                   help="force a portable attention path instead of the chosen backend")
    p.add_argument("--ab", default=None, metavar="OLD_ROOT",
                   help="time this model against OLD_ROOT's models/qwen3.py + loader.py")
    p.add_argument("--attention-ab", action="store_true",
                   help="time one layer's attention: per-run sdpa vs padded sdpa, alternating")
    p.add_argument("--count-ops", action="store_true",
                   help="print ops per decoder layer (torch profiler) instead of timing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        import fixtures

        model_dir = str(fixtures.cached(args.preset, layers=args.layers, root=args.fixture_root))
    runner = load_runner(model_dir, device=args.device, dtype=args.dtype)
    if args.attention:
        from models.attention.varlen import PORTABLE, AttentionBackend

        runner.model.layers[0].self_attn.ops.attention = AttentionBackend(
            args.attention, PORTABLE[args.attention])  # one AttentionOps object shared by all layers
        runner.attention_backend = args.attention
    if args.ab:
        rows = ab(runner, old_model(runner, args.ab, model_dir), batch=args.batch,
                  prefixes=args.prefix, suffix=args.suffix, warmup=args.warmup,
                  repeats=args.repeats, seed=args.seed)
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(f"# A/B {args.ab} (old) vs this checkout (new), {runner.device} "
              f"{str(runner.dtype).replace('torch.', '')}, attention {runner.attention_backend}, "
              f"{torch.get_num_threads()} threads, B={args.batch} S={args.suffix}, median of "
              f"{args.repeats}, old/new alternating")
        print(f"{'P':>5} {'mode':>8} {'N':>7} {'rows':>7} {'old_ms':>9} {'new_ms':>9} {'new/old':>8} {'max|d|':>8}")
        for r in rows:
            print(f"{r['prefix']:>5} {r['mode']:>8} {r['tokens']:>7} {r['rows']:>7} {r['old_ms']:>9.1f} "
                  f"{r['new_ms']:>9.1f} {r['new_over_old']:>8.3f} {r['max_abs_diff']:>8.1e}")
        return 0
    if args.attention_ab:
        rows = attention_ab(runner, batch=args.batch, prefixes=args.prefix, suffix=args.suffix,
                            repeats=args.repeats, seed=args.seed)
        print(f"# one layer's attention, {runner.device} {str(runner.dtype).replace('torch.', '')}, "
              f"B={args.batch} S={args.suffix}, median of {args.repeats}, alternating")
        print(f"{'P':>5} {'mode':>8} {'seqs':>5} {'runs':>5} {'buckets':>7} {'sdpa_ms':>8} "
              f"{'padded_ms':>9} {'padded/sdpa':>11} {'plan_ms':>7}")
        for r in rows:
            print(f"{r['prefix']:>5} {r['mode']:>8} {r['seqs']:>5} {r['runs']:>5} {r['buckets']:>7} "
                  f"{r['sdpa_ms']:>8.1f} {r['padded_ms']:>9.1f} {r['padded_over_sdpa']:>11.2f} "
                  f"{r['plan_ms']:>7.2f}")
        return 0
    if args.count_ops:
        counts = count_ops(runner, batch=args.batch, prefix=args.prefix[0], suffix=args.suffix,
                           seed=args.seed)
        if args.json:
            print(json.dumps(counts, indent=2))
        for mode, c in counts.items():
            ops = ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in c["ops"].items())
            print(f"{mode:>8}: {c['compute']:>3} compute ops/layer, {c['total']:>3} with views ({ops})")
        return 0
    rows = bench(runner, batch=args.batch, prefixes=args.prefix, suffix=args.suffix,
                 warmup=args.warmup, repeats=args.repeats, seed=args.seed, modes=args.modes)
    if args.json:
        print(json.dumps({"model": model_dir, "device": str(runner.device),
                          "dtype": str(runner.dtype).replace("torch.", ""),
                          "attention_backend": runner.attention_backend,
                          "threads": torch.get_num_threads(), "batch": args.batch,
                          "suffix": args.suffix, "rows": [asdict(r) for r in rows]}, indent=2))
        return 0
    print(f"# {model_dir} on {runner.device} {str(runner.dtype).replace('torch.', '')}, "
          f"attention {runner.attention_backend}, {torch.get_num_threads()} threads, "
          f"B={args.batch} S={args.suffix}, median of {args.repeats}")
    print(f"{'P':>5} {'mode':>8} {'N':>7} {'N_':>7} {'ratio':>6} {'ms':>9} {'speedup':>8} "
          f"{'amdahl':>7} {'of_amdahl':>9} {'f':>5} {'amdahl_t':>8} {'of_t':>5} {'f_t':>5} {'idx_ms':>7}")
    for r in rows:
        of = r.speedup / r.amdahl if r.mode != "off" else 1.0
        of_t = r.speedup / r.amdahl_time if r.mode != "off" else 1.0
        print(f"{r.prefix:>5} {r.mode:>8} {r.tokens:>7} {r.compact_tokens:>7} {r.ratio:>6.3f} "
              f"{r.median_ms:>9.1f} {r.speedup:>8.2f} {r.amdahl:>7.2f} {of:>9.0%} {r.pw_share:>5.3f} "
              f"{r.amdahl_time:>8.2f} {of_t:>5.0%} {r.pw_share_time:>5.3f} {r.index_ms:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
